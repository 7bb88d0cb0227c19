//! The routing oracle, a measurement mode of `smoe` (`SMOE_ROUTE_TRACE`): how close a streamed
//! GPU decode gets to the I/O bound when guessing which experts the next layers will want is not
//! what limits it. It is the engine's `RouteOracle` hook, implemented here with the bench code.
//!
//! A run with `SMOE_ROUTE_TRACE=record:PATH` writes every decode MoE layer's chosen experts to
//! PATH in the order the streaming decoder used them (one line per layer: the layer, then the
//! ids). A later run of the same requests with `SMOE_ROUTE_TRACE=replay:PATH[:DEPTH]` follows
//! that trace as it decodes and, after each window's read-back, starts reading the experts of
//! the next DEPTH MoE layers (default 4) that no VRAM slot holds, as needed reads — perfect
//! guesses in place of the lookahead router and the speculative pass, which it turns off. The
//! tokens do not change (the oracle only starts reads earlier); where the run departs from the
//! trace (another prompt or length), the oracle warns once and guesses nothing more.
//!
//! Only decode batches that run through (`through`) are traced; the expert budget may differ
//! between the two runs (routing does not depend on it).

use smoe_engine::tuning::RouteOracle;
use smoe_engine::EngineError;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// What `SMOE_ROUTE_TRACE` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteTrace {
    /// Write each decode MoE layer's choice to the file.
    Record(PathBuf),
    /// Start reading the true experts of the next `depth` MoE layers from the file's trace.
    Replay { path: PathBuf, depth: usize },
}

/// MoE layers the replay reads ahead unless told.
const DEFAULT_DEPTH: usize = 4;

impl RouteTrace {
    /// Parses `record:PATH` or `replay:PATH[:DEPTH]`.
    pub fn parse(v: &str) -> anyhow::Result<Self> {
        let bad =
            || anyhow::anyhow!("SMOE_ROUTE_TRACE={v}: expected record:PATH or replay:PATH[:DEPTH]");
        let (mode, rest) = v.split_once(':').ok_or_else(bad)?;
        match mode {
            "record" if !rest.is_empty() => Ok(RouteTrace::Record(rest.into())),
            "replay" => {
                let (path, depth) = match rest.rsplit_once(':') {
                    Some((p, d)) if d.chars().all(|c| c.is_ascii_digit()) && !d.is_empty() => {
                        (p, d.parse().map_err(|_| bad())?)
                    }
                    _ => (rest, DEFAULT_DEPTH),
                };
                if path.is_empty() || depth == 0 {
                    return Err(bad());
                }
                Ok(RouteTrace::Replay {
                    path: path.into(),
                    depth,
                })
            }
            _ => Err(bad()),
        }
    }
}

/// One MoE layer's choice: the layer and its expert ids (router order).
type Event = (usize, Vec<u32>);

pub enum Oracle {
    Record(Mutex<std::fs::File>),
    Replay {
        events: Vec<Event>,
        /// Events used so far.
        cursor: Mutex<usize>,
        depth: usize,
        /// The run departed from the trace.
        lost: AtomicBool,
    },
}

impl Oracle {
    pub fn open(t: &RouteTrace) -> anyhow::Result<Self> {
        let io = |p: &Path, e: std::io::Error| anyhow::anyhow!("route trace {}: {e}", p.display());
        Ok(match t {
            RouteTrace::Record(p) => {
                Oracle::Record(Mutex::new(std::fs::File::create(p).map_err(|e| io(p, e))?))
            }
            RouteTrace::Replay { path, depth } => {
                let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
                let events = parse_events(&text)
                    .map_err(|m| anyhow::anyhow!("route trace {}: {m}", path.display()))?;
                Oracle::Replay {
                    events,
                    cursor: Mutex::new(0),
                    depth: *depth,
                    lost: AtomicBool::new(false),
                }
            }
        })
    }
}

impl RouteOracle for Oracle {
    /// Whether this oracle guesses (and the decoder's own guesses are off).
    fn replays(&self) -> bool {
        matches!(self, Oracle::Replay { .. })
    }

    /// MoE layer `l` of a decode batch ran with the experts `ids`: written to the trace, or
    /// checked against it.
    fn used(&self, l: usize, ids: &[u32]) -> Result<(), EngineError> {
        match self {
            Oracle::Record(f) => {
                let mut line = l.to_string();
                for id in ids {
                    line.push(' ');
                    line.push_str(&id.to_string());
                }
                line.push('\n');
                let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
                f.write_all(line.as_bytes())
                    .map_err(|e| EngineError::Backend(format!("route trace: {e}")))
            }
            Oracle::Replay {
                events,
                cursor,
                lost,
                ..
            } => {
                if lost.load(Ordering::Relaxed) {
                    return Ok(());
                }
                let mut c = cursor.lock().unwrap_or_else(|e| e.into_inner());
                match events.get(*c) {
                    Some((el, eids)) if *el == l && eids[..] == *ids => *c += 1,
                    _ => {
                        lost.store(true, Ordering::Relaxed);
                        tracing::warn!(
                            "route trace: this run departed from the trace at its choice {} (layer {l}); the oracle guesses nothing more",
                            *c
                        );
                    }
                }
                Ok(())
            }
        }
    }

    /// The next `depth` MoE layers' choices of the trace, up to the first layer that comes
    /// again (none while recording or once lost).
    fn ahead(&self) -> Vec<Event> {
        match self {
            Oracle::Replay {
                events,
                cursor,
                depth,
                lost,
            } if !lost.load(Ordering::Relaxed) => {
                let c = *cursor.lock().unwrap_or_else(|e| e.into_inner());
                // Up to the next use of a layer already listed: a fill drops the reads of its
                // layer that it does not use, and those would be for that later use.
                let mut seen = vec![];
                (events.iter().skip(c).take(*depth))
                    .take_while(|(l, _)| {
                        let new = !seen.contains(l);
                        seen.push(*l);
                        new
                    })
                    .cloned()
                    .collect()
            }
            _ => vec![],
        }
    }
}

fn parse_events(text: &str) -> Result<Vec<Event>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            let mut nums = line.split_ascii_whitespace().map(|w| w.parse::<u32>());
            let bad = || format!("line {}: expected a layer and expert ids", i + 1);
            let layer = nums.next().and_then(|n| n.ok()).ok_or_else(bad)? as usize;
            let ids = nums.collect::<Result<Vec<u32>, _>>().map_err(|_| bad())?;
            if ids.is_empty() {
                return Err(bad());
            }
            Ok((layer, ids))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_modes_and_refuses_the_rest() {
        assert_eq!(
            RouteTrace::parse("record:/tmp/t").unwrap(),
            RouteTrace::Record("/tmp/t".into())
        );
        assert_eq!(
            RouteTrace::parse("replay:/tmp/t").unwrap(),
            RouteTrace::Replay {
                path: "/tmp/t".into(),
                depth: DEFAULT_DEPTH
            }
        );
        assert_eq!(
            RouteTrace::parse("replay:/tmp/a:b:8").unwrap(),
            RouteTrace::Replay {
                path: "/tmp/a:b".into(),
                depth: 8
            }
        );
        for bad in ["", "record:", "replay:", "replay:/t:0", "play:/t", "/tmp/t"] {
            assert!(RouteTrace::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn replay_follows_the_trace_and_stops_where_the_run_departs() {
        let dir = std::env::temp_dir().join(format!("smoe-oracle-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace");
        let rec = Oracle::open(&RouteTrace::Record(path.clone())).unwrap();
        for (l, ids) in [(1, [3, 4]), (3, [5, 6]), (1, [7, 8]), (3, [0, 1])] {
            rec.used(l, &ids).unwrap();
        }
        drop(rec);
        let rep = Oracle::open(&RouteTrace::Replay {
            path: path.clone(),
            depth: 2,
        })
        .unwrap();
        assert!(rep.replays());
        assert_eq!(rep.ahead(), vec![(1, vec![3, 4]), (3, vec![5, 6])]);
        rep.used(1, &[3, 4]).unwrap();
        assert_eq!(rep.ahead(), vec![(3, vec![5, 6]), (1, vec![7, 8])]);
        rep.used(3, &[5, 6]).unwrap();
        let wide = Oracle::open(&RouteTrace::Replay {
            path: path.clone(),
            depth: 4,
        })
        .unwrap();
        // Layer 1 comes again after layer 3: the list stops before it.
        assert_eq!(wide.ahead(), vec![(1, vec![3, 4]), (3, vec![5, 6])]);
        rep.used(1, &[7, 9]).unwrap(); // departs
        assert!(rep.ahead().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(parse_events("1 2 x\n").is_err());
        assert!(parse_events("1\n").is_err());
    }
}
