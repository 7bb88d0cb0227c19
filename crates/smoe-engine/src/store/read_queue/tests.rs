//! The queue's order and a blob read's life: pieces, failures, abandoned and promoted guesses,
//! and where the read buffers go.

use super::*;
use std::time::Instant;

const KIB16: usize = 16 * 1024;

fn read_in(pool: &Arc<BufPool>, key: usize, priority: Priority) -> Arc<BlobRead> {
    BlobRead::new((key, 0, key, key), 0, KIB16, (priority, None, None), pool)
}

fn read(key: usize, pieces: usize, priority: Priority) -> Arc<BlobRead> {
    read_in(&Arc::new(BufPool::new(pieces * KIB16, 4)), key, priority)
}

fn finish(r: &BlobRead, ok: bool) -> Finished {
    let res = if ok { Ok(()) } else { Err("bad".into()) };
    r.finish_piece(res, Ok)
}

#[test]
fn needed_pieces_go_first_and_guesses_are_capped() {
    let q = ReadQueue::new(1);
    let g = read(1, 2, Priority::Guess);
    let n = read(2, 2, Priority::Needed);
    q.push(&g);
    q.push(&n);
    let a = q.pop().unwrap();
    let b = q.pop().unwrap();
    assert_eq!((a.read.key, b.read.key), (2, 2));
    let c = q.pop().unwrap();
    assert_eq!(c.read.key, 1);
    // One guess reader is busy: the next guess piece waits until it is done.
    let queued = q.state();
    assert_eq!((queued.guessing, queued.guesses.len()), (1, 1));
    drop(queued);
    q.done(c);
    let d = q.pop().unwrap();
    assert_eq!(d.read.key, 1);
    q.done(a);
    q.done(b);
    q.done(d);
}

#[test]
fn guesses_for_nearer_layers_are_read_first() {
    let q = ReadQueue::new(8);
    let pool = Arc::new(BufPool::new(KIB16, 4));
    let guess = |key, layer| {
        BlobRead::new(
            (key, layer, key, key),
            0,
            KIB16,
            (Priority::Guess, None, None),
            &pool,
        )
    };
    // Pushed as a deeper lookahead pushes them (one layer's far guesses before a later
    // layer's near ones): taken by layer, in push order within a layer.
    for (key, layer) in [(1, 5), (2, 7), (3, 6), (4, 5), (5, 9), (6, 2)] {
        q.push(&guess(key, layer));
    }
    let order: Vec<usize> = (0..6).map(|_| q.pop().unwrap().read.key).collect();
    assert_eq!(order, [6, 1, 4, 3, 2, 5]);
}

#[test]
fn a_blob_is_handed_over_when_its_last_piece_ends() {
    let r = read(7, 3, Priority::Needed);
    let pieces: Vec<(usize, u64, usize)> = (0..3)
        .map(|_| {
            let (i, off, dst) = r.take_piece().unwrap().unwrap();
            dst.fill(i as u8 + 1);
            (i, off, dst.len())
        })
        .collect();
    assert_eq!(
        pieces,
        vec![
            (0, 0, KIB16),
            (1, KIB16 as u64, KIB16),
            (2, 2 * KIB16 as u64, KIB16)
        ]
    );
    assert!(r.take_piece().is_none());
    assert!(matches!(finish(&r, true), Finished::Nothing));
    assert!(matches!(finish(&r, true), Finished::Nothing));
    assert!(matches!(finish(&r, true), Finished::Nothing));
    let (key, buf, _) = r.wait();
    let buf = buf.unwrap();
    assert_eq!(key, 7);
    assert_eq!(buf.as_slice()[0], 1);
    assert_eq!(buf.as_slice()[2 * KIB16], 3);
}

#[test]
fn a_failed_piece_stops_the_rest_and_fails_the_blob() {
    let r = read(3, 4, Priority::Needed);
    let _ = r.take_piece().unwrap();
    let _ = r.take_piece().unwrap();
    assert!(matches!(finish(&r, false), Finished::Nothing));
    assert!(r.take_piece().is_none(), "nothing more is read");
    assert!(matches!(finish(&r, true), Finished::Nothing));
    assert!(r.wait().1.is_err());
}

#[test]
fn an_abandoned_guess_stops_and_a_promoted_one_jumps_the_queue() {
    let q = ReadQueue::new(4);
    let never = read(1, 3, Priority::Guess);
    q.push(&never);
    assert!(matches!(q.abandon(&never), Abandoned::Cancelled));
    assert!(never.take_piece().is_none());
    // Started, then abandoned: the piece out finishes, the blob is incomplete, dropped.
    let half = read(2, 3, Priority::Guess);
    let _ = half.take_piece().unwrap();
    assert!(matches!(half.abandon(), Abandoned::InFlight));
    assert!(half.take_piece().is_none());
    assert!(matches!(finish(&half, true), Finished::Nothing));
    // Abandoned while its last piece was out: whole, so its reader gets it to keep.
    let late = read(3, 1, Priority::Guess);
    let _ = late.take_piece().unwrap();
    assert!(matches!(late.abandon(), Abandoned::InFlight));
    assert!(matches!(
        finish(&late, true),
        Finished::Unneeded((3, Ok(_), _))
    ));
    // A guess promoted ahead of later guesses.
    let other = read(4, 1, Priority::Guess);
    let wanted = read(5, 2, Priority::Guess);
    q.push(&other);
    q.push(&wanted);
    q.promote(&wanted);
    assert_eq!(q.pop().unwrap().read.key, 5);
    assert_eq!(q.pop().unwrap().read.key, 5);
    assert_eq!(q.pop().unwrap().read.key, 4);
    q.close();
    assert!(q.pop().is_none());
}

#[test]
fn buffers_of_reads_not_handed_on_go_back_to_the_pool() {
    let pool = Arc::new(BufPool::new(2 * KIB16, 2));
    assert!(pool.top_up(), "a spare is allocated");
    assert!(!pool.top_up(), "up to half of `keep`");
    let r = read_in(&pool, 1, Priority::Guess);
    assert!(matches!(r.abandon(), Abandoned::Cancelled));
    drop(r);
    assert_eq!(pool.spare(), 1, "a cancelled guess took no buffer");
    let r = read_in(&pool, 2, Priority::Needed);
    let _ = r.take_piece().unwrap();
    assert_eq!(pool.spare(), 0, "reused by the first piece");
    assert!(matches!(finish(&r, false), Finished::Nothing));
    assert!(r.wait().1.is_err());
    drop(r);
    assert_eq!(pool.spare(), 1, "a failed read");
    let r = read_in(&pool, 3, Priority::Needed);
    for _ in 0..2 {
        let _ = r.take_piece().unwrap();
    }
    finish(&r, true);
    finish(&r, true);
    let buf = r.wait().1.unwrap();
    drop(r);
    assert_eq!(pool.spare(), 0, "a whole blob is handed on, not pooled");
    pool.give_shared(Arc::new(buf));
    pool.give(AlignedBuf::new(2 * KIB16).unwrap());
    pool.give(AlignedBuf::new(2 * KIB16).unwrap());
    assert_eq!(pool.spare(), 2, "at most `keep` wait");
    assert_eq!(pool.inline_allocs().0, 0, "every take found a spare");
}

#[test]
fn the_pools_thread_keeps_spares_ready_and_ends_with_the_pool() {
    let pool = Arc::new(BufPool::new(KIB16, 8));
    let weak = Arc::downgrade(&pool);
    let filler = std::thread::spawn(move || BufPool::fill(weak));
    let ready = |n: usize| {
        let until = Instant::now() + std::time::Duration::from_secs(10);
        while pool.spare() < n && Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        pool.spare()
    };
    assert_eq!(ready(4), 4, "half of `keep` allocated ahead");
    let taken: Vec<_> = (0..4).map(|_| pool.take().unwrap()).collect();
    assert_eq!(ready(4), 4, "refilled after the takes");
    assert_eq!(pool.inline_allocs().0, 0);
    drop(taken);
    drop(pool);
    filler.join().unwrap();
}
