//! The shared-memory ring: a lock-free single-producer single-consumer byte ring.
//!
//! Layout of a ring segment: a [`RingHeader`] of [`HEADER_BYTES`] (four cache lines: `head`,
//! `tail`, `consumer_sleeping`, `producer_waiting`, so the two sides never write the same
//! line), then `cap` bytes of data. `head` and `tail` are free-running byte counters (never
//! wrapped), so `head - tail` is the number of bytes in use and full/empty need no extra bit.
//!
//! A record is `[len u32][type u8][3 bytes zero][payload]`, padded to 8 bytes so every
//! record header is aligned. A record never straddles the end: when it does not fit before
//! the end, the producer writes a wrap marker (`len == u32::MAX`) and starts at offset 0;
//! past [`EARLY_WRAP`] it does the same as soon as the consumer has caught up.
//! Records are at most `cap / 4` bytes, so a wrap wastes at most a quarter of the ring.
//!
//! Ordering: the producer writes the record, then publishes `head` with `Release`; the
//! consumer loads `head` with `Acquire` before reading records, and publishes `tail` with
//! `Release` once it has copied a record out, which the producer loads with `Acquire` before
//! reusing the space. Each side keeps the other's position as last loaded and loads it
//! again only when that says empty (consumer) or full (producer): the other side writes
//! that line on every record, so a load per record would be a cache miss per record.
//!
//! Wakeups (Dekker style, so no wakeup is lost): a consumer about to sleep stores
//! `consumer_sleeping = 1`, issues a `SeqCst` fence and re-checks `head`; a producer stores
//! `head`, issues a `SeqCst` fence and checks the flag; with both fences at least one of
//! them sees the other's store. The producer that sees the flag clears it (swap) and
//! signals the consumer's eventfd. `producer_waiting` works the same way for a full ring.
//!
//! The peer is not trusted: every value read from shared memory (`head`, `tail`, record
//! lengths) is checked, and a bad one is a protocol error, never a panic or an
//! out-of-bounds access.
//!
//! Under `--cfg ibex_loom` the atomics come from `loom`, and the `loom_tests` module model
//! checks producer/consumer concurrency (see `docs/shm.md` for the command).

#[cfg(ibex_loom)]
use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(ibex_loom))]
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use crate::error::Error;

/// Bytes taken by the ring header at the start of a ring segment.
pub const HEADER_BYTES: usize = 256;
/// Bytes of a record header (`len`, `type`, padding).
pub const RECORD_HEADER: usize = 8;
const WRAP: u32 = u32::MAX;
/// A producer past this offset into the ring goes back to its start as soon as the
/// consumer has caught up (see [`Producer::try_push_parts`]).
const EARLY_WRAP: u64 = 4096;

#[repr(C, align(64))]
struct Line<T>(T);

/// The shared control block at the start of a ring segment.
#[repr(C)]
pub struct RingHeader {
    head: Line<AtomicU64>,
    tail: Line<AtomicU64>,
    consumer_sleeping: Line<AtomicU32>,
    producer_waiting: Line<AtomicU32>,
}

#[cfg(not(ibex_loom))]
const _: () = assert!(std::mem::size_of::<RingHeader>() == HEADER_BYTES);

impl RingHeader {
    /// True if the producer has published records the consumer has not taken: one load of
    /// each position, without the consumer, for a receiver watching the ring between two
    /// reads ([`crate::link::ReadyHint`]). A hint only: the consumer checks what it reads.
    pub fn pending(&self) -> bool {
        self.head.0.load(Ordering::Acquire) != self.tail.0.load(Ordering::Relaxed)
    }

    /// A fresh header (all counters zero), for rings that live on the heap (tests).
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn new() -> RingHeader {
        RingHeader {
            head: Line(AtomicU64::new(0)),
            tail: Line(AtomicU64::new(0)),
            consumer_sleeping: Line(AtomicU32::new(0)),
            producer_waiting: Line(AtomicU32::new(0)),
        }
    }
}

/// Largest payload a ring of `cap` data bytes accepts in one record.
pub fn max_payload(cap: usize) -> usize {
    (cap / 4).saturating_sub(RECORD_HEADER) & !7
}

fn padded(len: usize) -> u64 {
    (RECORD_HEADER + len.div_ceil(8) * 8) as u64
}

fn corrupt(what: &str) -> Error {
    Error::Protocol(format!("shared ring corrupted by peer: {what}"))
}

/// Checks a ring's geometry before anyone builds a producer or consumer over it.
pub fn check_capacity(cap: usize) -> Result<(), String> {
    if cap < 64 || !cap.is_multiple_of(8) || cap > (1 << 30) {
        return Err(format!(
            "ring capacity {cap} must be a multiple of 8 within 64 B..=1 GiB"
        ));
    }
    Ok(())
}

/// The writing end. Exactly one exists per ring.
pub struct Producer {
    hdr: *const RingHeader,
    data: *mut u8,
    cap: u64,
    head: u64,
    /// `tail` as this producer last loaded it. It only grows, so space free by it is
    /// free. A push loads `tail` again only when that is not enough room: `tail`'s line is
    /// written by the consumer on every pop, so loading it on every push is a miss on
    /// the other core, taken before the record can be written.
    tail_seen: u64,
    /// No early wrap is tried before `head` reaches this (one `tail` load per
    /// [`EARLY_WRAP`] bytes at most while the consumer lags).
    wrap_try_at: u64,
}

// SAFETY: the pointers refer to shared memory kept mapped by the owner of the producer for
// at least its lifetime; only this producer writes `head` and the free part of the data.
unsafe impl Send for Producer {}

impl Producer {
    /// A producer over a ring whose header is at `hdr` and data at `data..data+cap`.
    ///
    /// # Safety
    /// Both ranges must stay valid for reads and writes for the producer's lifetime,
    /// `data` must be 8-byte aligned, `cap` must pass [`check_capacity`], and there must be
    /// no other producer for this ring.
    pub unsafe fn new(hdr: *const RingHeader, data: *mut u8, cap: usize) -> Producer {
        // SAFETY: `hdr` is valid per the contract.
        let head = unsafe { &*hdr }.head.0.load(Ordering::Relaxed);
        Producer {
            hdr,
            data,
            cap: cap as u64,
            head,
            // The least `tail` can be: a push that needs more room loads it.
            tail_seen: head.saturating_sub(cap as u64),
            wrap_try_at: head,
        }
    }

    fn hdr(&self) -> &RingHeader {
        // SAFETY: valid for the producer's lifetime (constructor contract).
        unsafe { &*self.hdr }
    }

    /// Largest payload one record may carry.
    pub fn max_payload(&self) -> usize {
        max_payload(self.cap as usize)
    }

    /// Space needed for a payload of `len`, counting a wrap marker if the record would not
    /// fit before the end.
    fn need(&self, len: usize) -> u64 {
        let need = padded(len);
        let off = self.head % self.cap;
        let to_end = self.cap - off;
        if need > to_end { to_end + need } else { need }
    }

    /// The consumer's position now, checked.
    fn load_tail(&self) -> Result<u64, Error> {
        let tail = self.hdr().tail.0.load(Ordering::Acquire);
        if tail > self.head || self.head - tail > self.cap {
            return Err(corrupt("consumer position is outside the ring"));
        }
        Ok(tail)
    }

    /// True if a payload of `len` bytes fits now (`tail` loaded afresh: for a producer
    /// about to sleep, after [`Producer::set_waiting`]).
    pub fn has_room(&self, len: usize) -> Result<bool, Error> {
        let tail = self.load_tail()?;
        Ok(self.need(len) <= self.cap - (self.head - tail))
    }

    /// Appends one record. `Ok(false)` when the ring has no room for it now.
    #[cfg(test)]
    pub fn try_push(&mut self, ty: u8, payload: &[u8]) -> Result<bool, Error> {
        self.try_push_parts(ty, payload, &[])
    }

    /// [`Producer::try_push`] of one record whose payload is `a` followed by `b`, copied
    /// straight from both.
    pub fn try_push_parts(&mut self, ty: u8, a: &[u8], b: &[u8]) -> Result<bool, Error> {
        let len = a.len() + b.len();
        if len > self.max_payload() {
            return Err(Error::TooLarge {
                len: len as u64,
                limit: self.max_payload() as u64,
                which: "largest record of the shm ring (a quarter of its size)",
            });
        }
        let mut total = self.need(len);
        let off = self.head % self.cap;
        if off >= EARLY_WRAP && total == padded(len) && self.head >= self.wrap_try_at {
            // Back to the ring's start once the consumer has caught up: small messages
            // going back and forth then reuse the ring's first pages instead of walking
            // through all of it, so the rest is never faulted in (a whole ring, 4 MiB and
            // more, held per connection otherwise). Skipping to the end fits when what is
            // in use ends before this offset.
            let fits = |tail: u64| self.head - tail + padded(len) <= off;
            if !fits(self.tail_seen) {
                self.tail_seen = self.load_tail()?;
            }
            if fits(self.tail_seen) {
                total += self.cap - off;
            } else {
                self.wrap_try_at = self.head + EARLY_WRAP;
            }
        }
        if total > self.cap - (self.head - self.tail_seen) {
            self.tail_seen = self.load_tail()?;
            if total > self.cap - (self.head - self.tail_seen) {
                return Ok(false);
            }
        }
        let mut off = (self.head % self.cap) as usize;
        if total != padded(len) {
            // SAFETY: off < cap, off is a multiple of 8 and so is cap, so 8 bytes fit; the
            // space is free (checked above), so the consumer does not read it concurrently.
            unsafe { write_header(self.data.add(off), WRAP, 0) };
            off = 0;
        }
        // SAFETY: the record (header, then `a` and `b` back to back) fits in
        // off..off+padded(len) <= cap (checked above) and that space is free, so nobody
        // reads it until `head` is published below.
        unsafe {
            write_header(self.data.add(off), len as u32, ty);
            let at = self.data.add(off + RECORD_HEADER);
            std::ptr::copy_nonoverlapping(a.as_ptr(), at, a.len());
            std::ptr::copy_nonoverlapping(b.as_ptr(), at.add(a.len()), b.len());
        }
        self.head += total;
        self.hdr().head.0.store(self.head, Ordering::Release);
        Ok(true)
    }

    /// After a push: true if the consumer was asleep and must be woken (the flag is
    /// cleared here, so one push wakes it once).
    pub fn consumer_needs_wake(&self) -> bool {
        fence(Ordering::SeqCst);
        let flag = &self.hdr().consumer_sleeping.0;
        flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0
    }

    /// Announces that the producer will sleep until the consumer frees space. Re-check
    /// [`Producer::has_room`] afterwards before actually sleeping.
    pub fn set_waiting(&self) {
        self.hdr().producer_waiting.0.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Withdraws [`Producer::set_waiting`] (space was found after all).
    pub fn clear_waiting(&self) {
        self.hdr().producer_waiting.0.store(0, Ordering::Relaxed);
    }
}

/// # Safety
/// `at..at+8` must be valid for writes and 4-byte aligned.
unsafe fn write_header(at: *mut u8, len: u32, ty: u8) {
    let word = (len as u64) | ((ty as u64) << 32);
    // SAFETY: per the function contract (8-byte aligned in practice).
    unsafe { std::ptr::write_volatile(at.cast::<u64>(), word.to_le()) };
}

/// A record as seen in the ring, borrowed until [`Consumer::pop`].
#[derive(Debug)]
pub struct Record<'a> {
    /// The record type (0 = frame; the link defines the others).
    pub ty: u8,
    /// The payload, still in shared memory: copy it out before popping.
    pub payload: &'a [u8],
}

/// The reading end. Exactly one exists per ring.
pub struct Consumer {
    hdr: *const RingHeader,
    data: *const u8,
    cap: u64,
    tail: u64,
    head_seen: u64,
    /// Bytes of the record handed out by the last `peek`, consumed by `pop`.
    peeked: u64,
}

// SAFETY: as for `Producer`: the memory outlives the consumer, which alone writes `tail`.
unsafe impl Send for Consumer {}

impl Consumer {
    /// A consumer over a ring whose header is at `hdr` and data at `data..data+cap`.
    ///
    /// # Safety
    /// As for [`Producer::new`]; the data only needs to be readable.
    pub unsafe fn new(hdr: *const RingHeader, data: *const u8, cap: usize) -> Consumer {
        // SAFETY: `hdr` is valid per the contract.
        let tail = unsafe { &*hdr }.tail.0.load(Ordering::Relaxed);
        Consumer {
            hdr,
            data,
            cap: cap as u64,
            tail,
            head_seen: tail,
            peeked: 0,
        }
    }

    fn hdr(&self) -> &RingHeader {
        // SAFETY: valid for the consumer's lifetime (constructor contract).
        unsafe { &*self.hdr }
    }

    fn load_head(&mut self) -> Result<u64, Error> {
        let head = self.hdr().head.0.load(Ordering::Acquire);
        if head < self.tail || head - self.tail > self.cap {
            return Err(corrupt("producer position is outside the ring"));
        }
        self.head_seen = head;
        Ok(head)
    }

    /// True if nothing is waiting (one atomic load; for spinning).
    pub fn is_empty(&self) -> bool {
        self.hdr().head.0.load(Ordering::Acquire) == self.tail
    }

    /// The oldest record, if any. Call [`Consumer::pop`] to release it.
    pub fn peek(&mut self) -> Result<Option<Record<'_>>, Error> {
        loop {
            if self.tail == self.head_seen && self.load_head()? == self.tail {
                return Ok(None);
            }
            let avail = self.head_seen - self.tail;
            let off = (self.tail % self.cap) as usize;
            // SAFETY: off < cap and both are multiples of 8, so 8 bytes are in bounds.
            let word =
                u64::from_le(unsafe { std::ptr::read_volatile(self.data.add(off).cast::<u64>()) });
            let len = word as u32;
            let ty = (word >> 32) as u8;
            if len == WRAP {
                let to_end = self.cap - off as u64;
                if to_end > avail {
                    return Err(corrupt("wrap marker beyond the published data"));
                }
                self.tail += to_end;
                self.hdr().tail.0.store(self.tail, Ordering::Release);
                continue;
            }
            let need = padded(len as usize);
            if len as usize > max_payload(self.cap as usize)
                || need > avail
                || off as u64 + need > self.cap
            {
                return Err(corrupt(&format!(
                    "record of {len} bytes does not fit the ring"
                )));
            }
            self.peeked = need;
            // SAFETY: off+8..off+8+len lies within the ring (checked above) and the producer
            // does not touch it until `tail` moves past it.
            let payload = unsafe {
                std::slice::from_raw_parts(self.data.add(off + RECORD_HEADER), len as usize)
            };
            return Ok(Some(Record { ty, payload }));
        }
    }

    /// Releases the record returned by the last [`Consumer::peek`]. Returns true if the
    /// producer was waiting for space and must be woken (the flag is cleared here).
    pub fn pop(&mut self) -> bool {
        if self.peeked == 0 {
            return false;
        }
        self.tail += std::mem::take(&mut self.peeked);
        self.hdr().tail.0.store(self.tail, Ordering::Release);
        fence(Ordering::SeqCst);
        let flag = &self.hdr().producer_waiting.0;
        flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0
    }

    /// Announces that the consumer is about to sleep. Returns false (and withdraws the
    /// announcement) if data arrived meanwhile, in which case it must not sleep.
    pub fn prepare_sleep(&mut self) -> Result<bool, Error> {
        self.hdr().consumer_sleeping.0.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if self.load_head()? != self.tail {
            self.cancel_sleep();
            return Ok(false);
        }
        Ok(true)
    }

    /// Withdraws [`Consumer::prepare_sleep`] (the consumer is awake again).
    pub fn cancel_sleep(&self) {
        self.hdr().consumer_sleeping.0.store(0, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(ibex_loom)))]
mod tests {
    use super::*;

    struct Heap {
        hdr: Box<RingHeader>,
        data: Vec<u64>,
    }

    fn ring(cap: usize) -> (Heap, Producer, Consumer) {
        let mut h = Heap {
            hdr: Box::new(RingHeader::new()),
            data: vec![0u64; cap / 8],
        };
        let hp: *const RingHeader = &*h.hdr;
        let dp = h.data.as_mut_ptr().cast::<u8>();
        // SAFETY: the heap buffers live in `h`, which the tests keep alive longer.
        let (p, c) = unsafe { (Producer::new(hp, dp, cap), Consumer::new(hp, dp, cap)) };
        (h, p, c)
    }

    fn pop_vec(c: &mut Consumer) -> Option<(u8, Vec<u8>)> {
        let r = c.peek().unwrap()?;
        let out = (r.ty, r.payload.to_vec());
        c.pop();
        Some(out)
    }

    #[test]
    fn records_come_out_in_order_across_wraps() {
        let (_h, mut p, mut c) = ring(256);
        assert_eq!(p.max_payload(), 56);
        let mut expected = std::collections::VecDeque::new();
        for round in 0..300usize {
            let len = round % 57;
            let payload: Vec<u8> = (0..len).map(|i| (i + round) as u8).collect();
            if !p.try_push((round % 7) as u8, &payload).unwrap() {
                // Full: drain everything, then the push must succeed.
                while let Some(got) = pop_vec(&mut c) {
                    assert_eq!(Some(got), expected.pop_front());
                }
                assert!(p.try_push((round % 7) as u8, &payload).unwrap());
            }
            expected.push_back(((round % 7) as u8, payload));
            if round % 3 == 2 {
                while let Some(got) = pop_vec(&mut c) {
                    assert_eq!(Some(got), expected.pop_front());
                }
            }
        }
        while let Some(got) = pop_vec(&mut c) {
            assert_eq!(Some(got), expected.pop_front());
        }
        assert!(expected.is_empty());
        assert!(c.is_empty());
    }

    #[test]
    fn full_ring_refuses_then_accepts_after_pop() {
        let (_h, mut p, mut c) = ring(128);
        let mut pushed = 0;
        while p.try_push(0, &[1u8; 24]).unwrap() {
            pushed += 1;
        }
        assert_eq!(pushed, 4, "128 bytes hold four 32-byte records");
        assert!(!p.has_room(24).unwrap());
        assert_eq!(pop_vec(&mut c), Some((0, vec![1u8; 24])));
        assert!(p.has_room(24).unwrap());
        assert!(p.try_push(0, &[2u8; 24]).unwrap());
        let mut rest = Vec::new();
        while let Some(r) = pop_vec(&mut c) {
            rest.push(r.1[0]);
        }
        assert_eq!(rest, vec![1, 1, 1, 2]);
    }

    #[test]
    fn oversized_record_is_an_error_not_a_hang() {
        let (_h, mut p, _c) = ring(128);
        assert!(matches!(
            p.try_push(0, &[0u8; 25]),
            Err(Error::TooLarge { .. })
        ));
    }

    #[test]
    fn a_record_in_two_parts_reads_back_as_one_across_the_wrap() {
        let (_h, mut p, mut c) = ring(128);
        for round in 0..20u8 {
            let a = vec![round; usize::from(round % 5)];
            let b = vec![round.wrapping_add(100); usize::from(round % 7) + 3];
            assert!(p.try_push_parts(3, &a, &b).unwrap(), "round {round}");
            assert_eq!(pop_vec(&mut c), Some((3, [a, b].concat())), "round {round}");
        }
        assert!(matches!(
            p.try_push_parts(0, &[0u8; 20], &[0u8; 5]),
            Err(Error::TooLarge { len: 25, .. })
        ));
    }

    #[test]
    fn wake_flags_are_taken_once() {
        let (_h, mut p, mut c) = ring(128);
        assert!(c.prepare_sleep().unwrap());
        assert!(p.try_push(0, b"x").unwrap());
        assert!(p.consumer_needs_wake());
        assert!(!p.consumer_needs_wake(), "the flag is cleared by the waker");
        assert!(!c.prepare_sleep().unwrap(), "data is waiting, so no sleep");
        p.set_waiting();
        assert!(c.peek().unwrap().is_some());
        assert!(c.pop());
        p.clear_waiting();
    }

    #[test]
    fn corrupted_positions_are_protocol_errors() {
        let (h, mut p, mut c) = ring(128);
        h.hdr.head.0.store(1000, Ordering::Relaxed);
        assert!(matches!(c.peek(), Err(Error::Protocol(_))));
        h.hdr.head.0.store(0, Ordering::Relaxed);
        h.hdr.tail.0.store(7, Ordering::Relaxed);
        assert!(matches!(p.has_room(1), Err(Error::Protocol(_))));
        // A push loads `tail` only once the room it knew of is used up, then sees it.
        h.hdr.tail.0.store(1000, Ordering::Relaxed);
        let pushed = (0..20)
            .map(|_| p.try_push(0, b"x"))
            .find(|r| !matches!(r, Ok(true)));
        assert!(
            matches!(pushed, Some(Err(Error::Protocol(_)))),
            "{pushed:?}"
        );
        h.hdr.tail.0.store(0, Ordering::Relaxed);
        // A record header claiming more than was published.
        let (h2, _p2, mut c2) = ring(128);
        h2.hdr.head.0.store(16, Ordering::Relaxed);
        // SAFETY: the data buffer is ours and 8-byte aligned.
        unsafe { write_header(h2.data.as_ptr() as *mut u8, 20, 0) };
        assert!(matches!(c2.peek(), Err(Error::Protocol(_))));
    }

    #[test]
    fn threads_move_many_records_intact() {
        let (h, mut p, mut c) = ring(4096);
        let n = 20_000u32;
        let prod = std::thread::spawn(move || {
            for i in 0..n {
                let len = (i as usize * 13) % 200;
                let payload: Vec<u8> = (0..len).map(|j| (i as usize + j) as u8).collect();
                while !p.try_push((i % 200) as u8, &payload).unwrap() {
                    std::hint::spin_loop();
                }
            }
        });
        let mut i = 0u32;
        while i < n {
            let Some(r) = c.peek().unwrap() else {
                std::hint::spin_loop();
                continue;
            };
            let len = (i as usize * 13) % 200;
            assert_eq!(r.ty, (i % 200) as u8);
            assert_eq!(r.payload.len(), len);
            assert!(
                r.payload
                    .iter()
                    .enumerate()
                    .all(|(j, &b)| b == (i as usize + j) as u8)
            );
            c.pop();
            i += 1;
        }
        prod.join().unwrap();
        drop(h);
    }

    #[test]
    fn the_header_shows_records_not_taken_yet() {
        let (h, mut p, mut c) = ring(4096);
        assert!(!h.hdr.pending());
        assert!(p.try_push(1, b"abc").unwrap());
        assert!(h.hdr.pending(), "a published record shows");
        assert!(c.peek().unwrap().is_some());
        assert!(
            h.hdr.pending(),
            "a record peeked but not released still shows"
        );
        c.pop();
        assert!(!h.hdr.pending(), "nothing once the consumer has taken it");
    }

    #[test]
    fn a_caught_up_consumer_brings_the_producer_back_to_the_start() {
        let cap = 1 << 16;
        let (_h, mut p, mut c) = ring(cap);
        for i in 0..5_000usize {
            let payload = vec![i as u8; 90 + i % 20];
            assert!(p.try_push(1, &payload).unwrap());
            // Ping-pong: every record stays within the first lines of the ring.
            assert!(p.head % cap as u64 <= EARLY_WRAP + padded(payload.len()));
            assert_eq!(pop_vec(&mut c), Some((1, payload)));
        }
        assert!(p.head > cap as u64, "the producer went round the ring");
    }

    #[test]
    fn a_lagging_consumer_keeps_every_record_in_order_past_the_early_wrap() {
        let cap = 1 << 15;
        let (_h, mut p, mut c) = ring(cap);
        let mut expected = std::collections::VecDeque::new();
        for i in 0..20_000usize {
            let payload = vec![i as u8; (i * 7) % 300];
            if !p.try_push((i % 5) as u8, &payload).unwrap() {
                while let Some(got) = pop_vec(&mut c) {
                    assert_eq!(Some(got), expected.pop_front());
                }
                assert!(p.try_push((i % 5) as u8, &payload).unwrap());
            }
            expected.push_back(((i % 5) as u8, payload));
            // The consumer takes some, not all: it lags behind the producer.
            if i % 4 == 0 {
                for _ in 0..3 {
                    if let Some(got) = pop_vec(&mut c) {
                        assert_eq!(Some(got), expected.pop_front());
                    }
                }
            }
        }
        while let Some(got) = pop_vec(&mut c) {
            assert_eq!(Some(got), expected.pop_front());
        }
        assert!(expected.is_empty());
    }
}

#[cfg(all(test, ibex_loom))]
mod loom_tests {
    //! Model checks of the ring protocol. The eventfd is modelled by a mutex-protected
    //! counter and a condvar: a lost wakeup leaves a thread blocked forever, which loom
    //! reports as a deadlock.
    use super::*;
    use loom::sync::{Arc, Condvar, Mutex};
    use loom::thread;

    struct EventFd {
        count: Mutex<u64>,
        cv: Condvar,
    }

    impl EventFd {
        fn new() -> Self {
            EventFd {
                count: Mutex::new(0),
                cv: Condvar::new(),
            }
        }
        fn signal(&self) {
            *self.count.lock().unwrap() += 1;
            self.cv.notify_one();
        }
        fn wait(&self) {
            let mut c = self.count.lock().unwrap();
            while *c == 0 {
                c = self.cv.wait(c).unwrap();
            }
            *c = 0;
        }
    }

    struct Shared {
        hdr: RingHeader,
        data: std::cell::UnsafeCell<[u64; 8]>,
        data_ready: EventFd,
        space_ready: EventFd,
    }
    // SAFETY: the data array is only accessed through the ring protocol under test.
    unsafe impl Sync for Shared {}
    // SAFETY: as above.
    unsafe impl Send for Shared {}

    const CAP: usize = 64;

    fn shared() -> Arc<Shared> {
        Arc::new(Shared {
            hdr: RingHeader::new(),
            data: std::cell::UnsafeCell::new([0; 8]),
            data_ready: EventFd::new(),
            space_ready: EventFd::new(),
        })
    }

    fn ends(s: &Arc<Shared>) -> (Producer, Consumer) {
        let dp = s.data.get().cast::<u8>();
        // SAFETY: `s` is kept alive by both threads for the whole model run.
        unsafe {
            (
                Producer::new(&s.hdr, dp, CAP),
                Consumer::new(&s.hdr, dp, CAP),
            )
        }
    }

    /// Producer that sleeps when full, exactly as the link does.
    fn produce(s: &Shared, p: &mut Producer, items: &[(u8, usize)]) {
        for &(ty, len) in items {
            let payload = vec![ty; len];
            loop {
                if p.try_push(ty, &payload).unwrap() {
                    if p.consumer_needs_wake() {
                        s.data_ready.signal();
                    }
                    break;
                }
                p.set_waiting();
                if p.has_room(len).unwrap() {
                    p.clear_waiting();
                    continue;
                }
                s.space_ready.wait();
            }
        }
    }

    /// Consumer that sleeps when empty, exactly as the link does.
    fn consume(s: &Shared, c: &mut Consumer, n: usize) -> Vec<(u8, usize)> {
        let mut got = Vec::new();
        while got.len() < n {
            match c.peek().unwrap() {
                Some(r) => {
                    assert!(r.payload.iter().all(|&b| b == r.ty), "torn record");
                    got.push((r.ty, r.payload.len()));
                    if c.pop() {
                        s.space_ready.signal();
                    }
                }
                None => {
                    if c.prepare_sleep().unwrap() {
                        s.data_ready.wait();
                    }
                }
            }
        }
        got
    }

    fn run(items: &'static [(u8, usize)]) {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(move || {
            let s = shared();
            let (mut p, mut c) = ends(&s);
            let s2 = s.clone();
            let t = thread::spawn(move || produce(&s2, &mut p, items));
            let got = consume(&s, &mut c, items.len());
            t.join().unwrap();
            assert_eq!(got, items.to_vec());
        });
    }

    #[test]
    fn empty_then_data_no_lost_wakeup() {
        run(&[(1, 3), (2, 0)]);
    }

    #[test]
    fn wrap_marker_and_content_survive() {
        // 64-byte ring, records of 16 bytes: the third push wraps.
        run(&[(1, 8), (2, 8), (3, 1), (4, 8)]);
    }

    #[test]
    fn full_ring_producer_sleeps_and_is_woken() {
        // Four 16-byte records fill the ring; the fifth must wait for the consumer.
        run(&[(1, 8), (2, 8), (3, 8), (4, 8), (5, 8)]);
    }
}
