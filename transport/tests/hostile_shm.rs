//! The hostile-peer suite over shm (see `hostile_util`): every class of bad frame, each
//! truncation, oversize lengths and counts, a window overrun, silence, an RTS for memory
//! never exposed, disconnects mid-rendezvous and 200 idle connections, while an honest
//! client keeps exchanging verified messages.
//!
//! A forged read has no shm case: the reader copies from the peer's memory itself (CMA or
//! the shared pool), so a peer can only ever read what its own uid may read anyway
//! (`docs/security.md`).

mod hostile_util;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_every_bad_peer_is_closed_and_the_honest_one_is_served() {
    hostile_util::run_suite("shm", 200, None, true).await;
}
