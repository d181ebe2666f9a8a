//! Threads of Ibex's own that serve accepted connections ([`crate::Config::serve_threads`]).
//!
//! On a work-stealing runtime a connection's tasks (its driver, the gRPC server's reader)
//! run on whichever worker picks them up, and a spinning receiver's every step wakes an
//! idle worker, which searches, may steal the connection to another thread, and parks
//! again. A home is a single-thread runtime on a thread of its own: a connection set up
//! there keeps all its tasks on that thread, as in eRPC's or iceoryx2's thread per core.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The process's homes, started on first use and kept for the life of the process (an
/// idle one sleeps in `epoll_wait`). Listeners asking for fewer share the first ones.
static HOMES: Mutex<Vec<tokio::runtime::Handle>> = Mutex::new(Vec::new());
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The home for the next connection when a listener serves on `n` threads, or `None`
/// (serve on the accepting runtime): `n` is 0, or no home could be started (logged).
pub(crate) fn next(n: usize) -> Option<tokio::runtime::Handle> {
    if n == 0 {
        return None;
    }
    let mut homes = HOMES.lock().unwrap_or_else(|e| e.into_inner());
    while homes.len() < n {
        match start(homes.len()) {
            Ok(h) => homes.push(h),
            Err(e) => {
                tracing::warn!(
                    %e,
                    started = homes.len(),
                    wanted = n,
                    "could not start a serving thread (Config::serve_threads, IBEX_SERVE_THREADS); using the ones there are"
                );
                break;
            }
        }
    }
    let have = homes.len().min(n);
    if have == 0 {
        return None;
    }
    // Round robin: connections of one job are alike, and a peer that reconnects takes the
    // next thread rather than piling onto one.
    Some(homes[NEXT.fetch_add(1, Ordering::Relaxed) % have].clone())
}

fn start(i: usize) -> std::io::Result<tokio::runtime::Handle> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let handle = rt.handle().clone();
    std::thread::Builder::new()
        .name(format!("ibex-serve-{i}"))
        .spawn(move || rt.block_on(std::future::pending::<()>()))?;
    Ok(handle)
}
