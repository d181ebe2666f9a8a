//! Threads of Ibex's own that serve accepted connections ([`crate::Config::serve_threads`]).
//!
//! On a work-stealing runtime a connection's tasks (its driver, the gRPC server's reader)
//! run on whichever worker picks them up, and a spinning receiver's every step wakes an
//! idle worker, which searches, may steal the connection to another thread, and parks
//! again. A home is a runtime with one worker thread of its own: a connection set up there
//! keeps all its tasks on that thread, as in eRPC's or iceoryx2's thread per core.
//!
//! Handlers keep tokio's rules there: the gRPC server polls a homed connection with the
//! listener's runtime entered, so what a handler spawns (`tokio::spawn`, `spawn_blocking`)
//! runs on the application's runtime as over stock tonic, and a home is a multi-thread
//! runtime, so `block_in_place` works as on any tokio server.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The process's homes, started on first use and kept for the life of the process (an
/// idle one sleeps in `epoll_wait`). Listeners asking for fewer share the first ones.
static HOMES: Mutex<Vec<tokio::runtime::Runtime>> = Mutex::new(Vec::new());
static NEXT: AtomicUsize = AtomicUsize::new(0);

tokio::task_local! {
    /// The home an accepted connection's set-up runs on. A task-local, not the thread's:
    /// a handler on a home that connects elsewhere makes a connection of the application's.
    static SETTING_UP_ON: tokio::runtime::Handle;
}

/// Runs an accepted connection's set-up `fut` for `home` (spawned there): the connection
/// it makes lives there ([`current`]).
pub(crate) async fn set_up_on<F: Future>(home: tokio::runtime::Handle, fut: F) -> F::Output {
    SETTING_UP_ON.scope(home, fut).await
}

/// The home of the connection being set up in this task, if it has one.
pub(crate) fn current() -> Option<tokio::runtime::Handle> {
    SETTING_UP_ON.try_with(Clone::clone).ok()
}

/// The home for the next connection when a listener serves on `n` threads, or `None`
/// (serve on the accepting runtime): `n` is 0, or no home could be started (logged).
pub(crate) fn next(n: usize) -> Option<tokio::runtime::Handle> {
    if n == 0 {
        return None;
    }
    let mut homes = HOMES.lock().unwrap_or_else(|e| e.into_inner());
    while homes.len() < n {
        match start(homes.len()) {
            Ok(rt) => homes.push(rt),
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
    Some(
        homes[NEXT.fetch_add(1, Ordering::Relaxed) % have]
            .handle()
            .clone(),
    )
}

fn start(i: usize) -> std::io::Result<tokio::runtime::Runtime> {
    // One worker, so nothing is stolen and a wake-up has no idle worker to notify; a
    // multi-thread runtime still, so a handler's `block_in_place` hands the connection's
    // tasks to a fresh thread as on any tokio server rather than panicking.
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(format!("ibex-serve-{i}"))
        .enable_all()
        .build()
}
