//! The physical floor beside every latency run: two processes ping-pong over one shared
//! cache line, once both spinning and once each sleeping on a futex. No transport, no
//! runtime, no allocation: what a round trip between two processes on this machine costs at
//! the least, in each waiting mode. Ibex's latencies are judged against it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::Res;
use crate::report::{Record, self_peak_rss_kib};

/// How each side waits for the other's write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Wait {
    /// Busy-polls the line (the best case for a run-to-completion RPC that spins).
    Spin,
    /// Sleeps in `futex(FUTEX_WAIT)`, woken by the writer's `futex(FUTEX_WAKE)` (the
    /// best case for a receiver that sleeps: one wake-up and one context switch per hop).
    Futex,
}

impl Wait {
    fn label(self) -> &'static str {
        match self {
            Wait::Spin => "spin",
            Wait::Futex => "futex",
        }
    }
}

/// The shared line: `turn` is odd while the child owes an answer, even while the parent
/// does; `stop` ends the child.
#[repr(C, align(64))]
struct Line {
    turn: AtomicU32,
    stop: AtomicU32,
}

fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned u32 in a shared mapping both processes keep mapped
    // until they exit; FUTEX_WAIT only reads it, and `ts` outlives the call. The call
    // returns at once if the word no longer holds `seen`, and after `timeout` at the latest.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            seen,
            &ts as *const libc::timespec,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: as in `futex_wait`; FUTEX_WAKE does not touch the word's memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1);
    }
}

/// Waits until `turn` leaves `seen`; returns the new value.
fn wait_change(line: &Line, seen: u32, how: Wait) -> u32 {
    loop {
        let v = line.turn.load(Ordering::Acquire);
        if v != seen || line.stop.load(Ordering::Acquire) != 0 {
            return v;
        }
        match how {
            Wait::Spin => std::hint::spin_loop(),
            // A bounded sleep, so a parent that died cannot leave the child asleep forever.
            Wait::Futex => futex_wait(&line.turn, seen, Duration::from_millis(100)),
        }
    }
}

fn set(line: &Line, v: u32, how: Wait) {
    line.turn.store(v, Ordering::Release);
    if how == Wait::Futex {
        futex_wake(&line.turn);
    }
}

/// Runs one floor measurement for `duration` after `warmup`, in a forked child and this
/// process. Must be called before any other thread exists (the child only spins, makes
/// futex calls and exits).
pub fn measure(how: Wait, warmup: Duration, duration: Duration) -> Res<Record> {
    let len = std::mem::size_of::<Line>();
    // SAFETY: an anonymous shared mapping: no file, no existing memory is touched. It is
    // zero-filled, which is a valid `Line` (two atomics at 0).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("floor: mmap failed: {}", std::io::Error::last_os_error()).into());
    }
    // SAFETY: the mapping is page-aligned, at least `len` bytes and zeroed (see above), and
    // stays mapped until the `munmap` below, after the child has exited.
    let line: &Line = unsafe { &*(p as *const Line) };
    // SAFETY: the caller runs this before starting threads; the child runs only
    // async-signal-safe work (atomics, futex) and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("floor: fork failed: {}", std::io::Error::last_os_error()).into());
    }
    if pid == 0 {
        // The child answers every odd value with the next even one.
        let mut seen = 0;
        loop {
            let v = wait_change(line, seen, how);
            if line.stop.load(Ordering::Acquire) != 0 {
                // SAFETY: ends the forked child without running the parent's destructors.
                unsafe { libc::_exit(0) };
            }
            if v % 2 == 1 {
                set(line, v.wrapping_add(1), how);
                seen = v.wrapping_add(1);
            } else {
                seen = v;
            }
        }
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let mut v = 0u32;
    let start = Instant::now();
    let mut measured_from = None;
    let mut calls = 0u64;
    loop {
        let now = Instant::now();
        if measured_from.is_none() && now - start >= warmup {
            measured_from = Some(now);
        }
        if let Some(m) = measured_from
            && now - m >= duration
        {
            break;
        }
        let t0 = Instant::now();
        v = v.wrapping_add(1);
        set(line, v, how);
        // Wait for the child's answer; it writes v + 1.
        loop {
            let got = wait_change(line, v, how);
            if got != v {
                v = got;
                break;
            }
        }
        if measured_from.is_some() {
            hist.record((t0.elapsed().as_nanos() as u64).max(1))?;
            calls += 1;
        }
    }
    let secs = measured_from.map_or(0.0, |m| m.elapsed().as_secs_f64());
    line.stop.store(1, Ordering::Release);
    futex_wake(&line.turn);
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a valid out-pointer.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    // SAFETY: unmaps the mapping made above; `line` is not used after this.
    unsafe { libc::munmap(p, len) };
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    Ok(Record {
        bench: "floor".into(),
        transport: "local".into(),
        payload: how.label().into(),
        bytes: 4,
        window: 1,
        topology: "1x1".into(),
        calls,
        p50_us: us(0.5),
        p99_us: us(0.99),
        p999_us: us(0.999),
        mean_us: hist.mean() / 1000.0,
        mb_s: 0.0,
        rpc_s: if secs > 0.0 { calls as f64 / secs } else { 0.0 },
        client_rss_kib: self_peak_rss_kib(),
        server_rss_kib: 0,
        round: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_floors_complete_round_trips() {
        for how in [Wait::Spin, Wait::Futex] {
            let r = measure(how, Duration::ZERO, Duration::from_millis(50)).unwrap();
            assert!(r.calls > 0, "{how:?}: no round trip finished");
            assert!(r.p50_us > 0.0 && r.p50_us <= r.p99_us, "{how:?}: {r:?}");
            assert_eq!(r.bench, "floor");
        }
    }
}
