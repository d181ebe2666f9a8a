//! The hostile-peer suite over tcp (see `hostile_util`): every class of bad frame, each
//! truncation, oversize lengths and counts, a window overrun, silence, an RTS for memory
//! never exposed, a read of a region never given out, disconnects mid-rendezvous and
//! 1000 idle connections, while an honest client keeps exchanging verified messages.

mod hostile_util;

use bytes::{BufMut, BytesMut};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_every_bad_peer_is_closed_and_the_honest_one_is_served() {
    // A region id the server never handed out: tcp's descriptor is (region id, length).
    let mut forged = BytesMut::new();
    forged.put_u64_le(0xdead_beef);
    forged.put_u64_le(4096);
    hostile_util::run_suite("tcp", 1000, Some(forged.freeze()), true).await;
}
