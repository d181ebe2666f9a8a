//! The hostile-peer suite over verbs (see `hostile_util`), in the Soft-RoCE VM
//! (`scripts/verbs-test.sh` runs every `verbs_*` binary there): every class of bad frame,
//! truncation at each field boundary (each verbs set-up registers memory, which takes
//! seconds under emulation, so not at every byte as on tcp and shm), oversize lengths and
//! counts, a window overrun, silence, an RTS for memory never exposed, disconnects
//! mid-rendezvous and idle connections, while an honest client keeps exchanging verified
//! messages. A read with a forged rkey is `verbs_link.rs`'s
//! `wrong_rkey_fails_the_read_then_the_link`: the NIC refuses it.
#![cfg(feature = "verbs")]

mod hostile_util;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_every_bad_peer_is_closed_and_the_honest_one_is_served() {
    if std::env::var("RXE_VM").is_err() {
        println!("skipped: no RDMA device (run scripts/verbs-test.sh)");
        return;
    }
    hostile_util::run_suite("verbs", 8, None, false).await;
}
