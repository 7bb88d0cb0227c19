//! How long the disk was busy, and how many reads it had in flight meanwhile: read GB/s over
//! busy time, the mean queue depth, and the disk's idle time that lookahead could have used.

use std::time::Instant;

/// Reads in flight and the time they took: `ever` since the store opened (with `opened`, the
/// disk's idle time), `ever - at_reset` since the last reset (read GB/s); and the reads in
/// flight summed over time (`depth`), so that busy time can tell a deep queue from one read
/// at a time.
pub(super) struct Busy {
    ever: f64,
    at_reset: f64,
    n: usize,
    since: Option<Instant>,
    opened: Instant,
    /// ∫ reads in flight dt since the store opened, up to `last`, and at the last reset.
    depth: f64,
    depth_at_reset: f64,
    last: Instant,
}

impl Busy {
    pub(super) fn new() -> Self {
        Busy {
            ever: 0.0,
            at_reset: 0.0,
            n: 0,
            since: None,
            opened: Instant::now(),
            depth: 0.0,
            depth_at_reset: 0.0,
            last: Instant::now(),
        }
    }

    /// A read started (`start`) or ended.
    pub(super) fn change(&mut self, start: bool) {
        self.change_at(start, Instant::now());
    }

    /// `change` at `now` (tests give their own instants).
    fn change_at(&mut self, start: bool, now: Instant) {
        self.depth += self.n as f64 * now.duration_since(self.last).as_secs_f64();
        self.last = now;
        if start {
            if self.n == 0 {
                self.since = Some(now);
            }
            self.n += 1;
        } else {
            self.n -= 1;
            if self.n == 0 {
                if let Some(t) = self.since.take() {
                    self.ever += now.duration_since(t).as_secs_f64();
                }
            }
        }
    }

    /// Busy seconds since the last `reset` (of the reads that have finished).
    pub(super) fn secs(&self) -> f64 {
        self.ever - self.at_reset
    }

    /// Reads in flight on average while at least one was, since the last `reset` (of the
    /// reads that have finished; 0 before any).
    pub(super) fn mean_depth(&self) -> f64 {
        let busy = self.secs();
        match busy > 0.0 {
            true => (self.depth - self.depth_at_reset) / busy,
            false => 0.0,
        }
    }

    /// Starts the counts since the last reset afresh. A busy stretch still running is split
    /// here, so that its part before the reset is not counted after it (a disk kept busy
    /// across a warm-up's end would otherwise count busy longer than the run).
    pub(super) fn reset(&mut self) {
        self.reset_at(Instant::now());
    }

    /// `reset` at `now`.
    fn reset_at(&mut self, now: Instant) {
        if let Some(t) = self.since.as_mut() {
            self.ever += now.duration_since(*t).as_secs_f64();
            *t = now;
        }
        self.depth += self.n as f64 * now.duration_since(self.last).as_secs_f64();
        self.last = now;
        self.at_reset = self.ever;
        self.depth_at_reset = self.depth;
    }

    pub(super) fn idle_s(&self) -> f64 {
        let open = self.since.map_or(0.0, |t| t.elapsed().as_secs_f64());
        (self.opened.elapsed().as_secs_f64() - self.ever - open).max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::Busy;
    use std::time::Duration;

    /// The disk's idle clock stands still while a read is in flight, however many overlap,
    /// and runs while none is; the busy time since the store opened survives a reset.
    #[test]
    fn the_idle_clock_runs_only_while_no_read_is_in_flight() {
        let mut b = Busy::new();
        let nap = Duration::from_millis(20);
        b.change(true);
        b.change(true);
        let i0 = b.idle_s();
        std::thread::sleep(nap);
        b.change(false);
        std::thread::sleep(nap);
        let i1 = b.idle_s();
        b.change(false);
        assert!((i1 - i0).abs() < 1e-3, "idle {i0} -> {i1} while reading");
        assert!(
            b.secs() >= 0.04 && b.ever == b.secs(),
            "{} {}",
            b.secs(),
            b.ever
        );
        b.reset();
        assert_eq!(b.secs(), 0.0);
        std::thread::sleep(nap);
        let i2 = b.idle_s();
        assert!(i2 - i1 >= 0.019, "idle {i1} -> {i2} with nothing in flight");
        assert!(b.ever >= 0.04);
    }

    /// Two reads for one span and one for the next: 1.5 reads in flight on average while
    /// busy; the idle time between does not count, and a reset starts afresh.
    #[test]
    fn the_mean_depth_counts_reads_in_flight_while_busy() {
        let mut b = Busy::new();
        assert_eq!(b.mean_depth(), 0.0, "nothing read yet");
        let ms = |n: u64| Duration::from_millis(n);
        let t = b.last;
        b.change_at(true, t);
        b.change_at(true, t);
        b.change_at(false, t + ms(30));
        b.change_at(false, t + ms(60));
        // Idle from 60 to 100 ms: not in the mean.
        assert!((b.mean_depth() - 1.5).abs() < 1e-9, "{}", b.mean_depth());
        assert!((b.secs() - 0.06).abs() < 1e-9, "{}", b.secs());
        b.reset_at(t + ms(100));
        assert_eq!(b.mean_depth(), 0.0);
        b.change_at(true, t + ms(100));
        b.change_at(false, t + ms(130));
        assert!((b.mean_depth() - 1.0).abs() < 1e-9, "one read at a time");
    }

    /// A read in flight across a reset counts after it only for its time after it.
    #[test]
    fn a_read_spanning_a_reset_counts_only_its_part_after_it() {
        let mut b = Busy::new();
        let ms = |n: u64| Duration::from_millis(n);
        let t = b.last;
        b.change_at(true, t);
        b.change_at(true, t);
        b.reset_at(t + ms(150));
        b.change_at(false, t + ms(170));
        b.change_at(false, t + ms(170));
        assert!(
            (b.secs() - 0.02).abs() < 1e-9,
            "busy {} s after the reset",
            b.secs()
        );
        assert!(
            (b.mean_depth() - 2.0).abs() < 1e-9,
            "depth {}",
            b.mean_depth()
        );
        assert!((b.ever - 0.17).abs() < 1e-9, "busy since open {}", b.ever);
    }
}
