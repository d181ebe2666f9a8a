//! Link-level tests of the verbs provider, driven with `poll_fn` (no connection driver).
//!
//! Tests that need an RDMA device run inside the Soft-RoCE VM (`scripts/verbs-test.sh`, which
//! sets `RXE_VM=1`); elsewhere they print why they skip. Inside the VM they never skip.
//! Device names and the listen address come from `IBEX_TEST_SERVER_DEV`,
//! `IBEX_TEST_CLIENT_DEV` and `IBEX_TEST_LISTEN_ADDR`, so the same tests run on one device
//! and across two (rxeA <-> rxeB).
#![cfg(feature = "verbs")]

use std::future::poll_fn;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use ibex_test_support::pattern;
use ibex_transport::Config;
use ibex_transport::error::Error;
use ibex_transport::link::{Link, LinkEvent, Registration};
use ibex_transport::verbs::{self, VerbsLink, VerbsOptions};

/// Generous: Soft-RoCE under TCG emulation is slow, but nothing here may hang forever.
const LIMIT: Duration = Duration::from_secs(30);

struct Env {
    server: VerbsOptions,
    client: VerbsOptions,
    listen: String,
}

fn env() -> Option<Env> {
    if std::env::var("RXE_VM").is_err() {
        println!("skipped: no RDMA device (run scripts/verbs-test.sh)");
        return None;
    }
    let dev = |v: &str| {
        std::env::var(v)
            .ok()
            .or_else(|| std::env::var("RXE_DEV").ok())
    };
    let busy = std::env::var("IBEX_VERBS_BUSY_POLL").is_ok_and(|v| v == "1");
    Some(Env {
        server: VerbsOptions {
            device: dev("IBEX_TEST_SERVER_DEV"),
            busy_poll: busy,
            ..Default::default()
        },
        client: VerbsOptions {
            device: dev("IBEX_TEST_CLIENT_DEV"),
            busy_poll: busy,
            ..Default::default()
        },
        listen: std::env::var("IBEX_TEST_LISTEN_ADDR").unwrap_or_else(|_| "127.0.0.1:0".into()),
    })
}

fn small_config() -> Config {
    Config {
        slot_size: 4096,
        credits: 8,
        pool_size: 8 << 20,
        ..Config::default()
    }
}

async fn pair_with(env: &Env, sc: &Config, cc: &Config) -> (VerbsLink, VerbsLink) {
    let l = verbs::listen_with(&env.listen, sc, env.server.clone())
        .await
        .expect("listen");
    let addr = l.local_addr().to_string();
    let (s, c) = tokio::join!(
        l.accept(),
        verbs::connect_with(&addr, cc, env.client.clone())
    );
    (s.expect("accept"), c.expect("connect"))
}

async fn send(link: &mut VerbsLink, frame: &[u8]) {
    poll_fn(|cx| link.poll_send(cx, frame)).await.expect("send");
}

async fn next(link: &mut VerbsLink) -> Result<LinkEvent, Error> {
    tokio::time::timeout(LIMIT, poll_fn(|cx| link.poll_event(cx)))
        .await
        .expect("event within the time limit")
}

/// One read for [`read_all`]: id, descriptor, offset in the exposure, destination, length.
type Read<'a> = (u64, &'a [u8], u64, *mut u8, usize);

/// Posts `reads` as the connection does: at most the link's read depth outstanding, the
/// next one as each completes. Returns each read's result by id, in completion order.
/// Safety: every destination must outlive the call and the link.
async unsafe fn read_all(c: &mut VerbsLink, reads: &[Read<'_>]) -> Vec<(u64, Result<(), Error>)> {
    let depth = c.read_depth();
    let (mut next_post, mut out) = (0, Vec::new());
    while out.len() < reads.len() {
        while next_post < reads.len() && next_post - out.len() < depth {
            let (id, desc, off, dst, len) = reads[next_post];
            // SAFETY: the caller keeps `dst` alive (see above).
            unsafe { c.post_read(id, desc, off, dst, len) }.expect("post_read within the depth");
            next_post += 1;
        }
        match next(c).await.expect("event") {
            LinkEvent::ReadDone { id, result } => out.push((id, result)),
            other => panic!("unexpected {other:?}"),
        }
    }
    out
}

async fn frame(link: &mut VerbsLink) -> Bytes {
    match next(link).await.expect("event") {
        LinkEvent::Frame(b) => b,
        other => panic!("expected a frame, got {other:?}"),
    }
}

#[tokio::test]
async fn setup_info_and_a_frame_each_way() {
    let Some(env) = env() else { return };
    let (mut s, mut c) = pair_with(
        &env,
        &small_config(),
        &Config {
            slot_size: 8192,
            ..small_config()
        },
    )
    .await;
    let (si, ci) = (s.info(), c.info());
    assert_eq!(si.provider, "verbs");
    assert_eq!(si.rendezvous_path, "rdma-read");
    assert!(si.one_sided);
    // Each side may send at most the peer's slot size.
    assert_eq!(si.max_frame, 8192);
    assert_eq!(ci.max_frame, 4096);
    assert!(c.read_depth() >= 1);
    send(&mut c, b"hello server").await;
    assert_eq!(&frame(&mut s).await[..], b"hello server");
    send(&mut s, b"hello client").await;
    assert_eq!(&frame(&mut c).await[..], b"hello client");
    // Oversized frames are refused up front.
    let big = vec![0u8; 4097];
    let r = poll_fn(|cx| c.poll_send(cx, &big)).await;
    assert!(matches!(r, Err(Error::TooLarge { .. })), "{r:?}");
}

#[tokio::test]
async fn hundreds_of_frames_arrive_in_order_and_intact() {
    let Some(env) = env() else { return };
    let cfg = small_config();
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    let max = c.info().max_frame;
    let sizes: Vec<usize> = (0..400)
        .map(|i| {
            if i < 2 {
                i * max
            } else {
                (i * 977) % (max + 1)
            }
        })
        .collect();
    let tx = {
        let sizes = sizes.clone();
        async move {
            for (i, &n) in sizes.iter().enumerate() {
                send(&mut c, &pattern(n, i as u8)).await;
            }
            c
        }
    };
    let rx = async move {
        for (i, &n) in sizes.iter().enumerate() {
            let f = frame(&mut s).await;
            assert_eq!(f.len(), n, "frame {i} length");
            assert!(f[..] == pattern(n, i as u8)[..], "frame {i} content");
        }
        s
    };
    let (_c, _s) = tokio::join!(tx, rx);
}

/// `poll_send_parts` writes a head and a body into one frame without joining them first:
/// inline (under the device's inline limit) and through a send slot, with either part empty.
#[tokio::test]
async fn two_part_frames_arrive_as_one() {
    let Some(env) = env() else { return };
    let cfg = small_config();
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    let (max, inline) = (c.info().max_frame, c.max_inline());
    let mut cases = vec![(0, 0), (5, 0), (0, 7), (12, 52), (16, max - 16), (max, 0)];
    if inline > 0 {
        cases.extend([(inline / 2, inline - inline / 2), (1, inline)]);
    }
    for (i, &(h, b)) in cases.iter().enumerate() {
        let whole = pattern(h + b, i as u8);
        let (head, body) = whole.split_at(h);
        poll_fn(|cx| c.poll_send_parts(cx, head, body))
            .await
            .expect("send parts");
        let f = frame(&mut s).await;
        assert!(f[..] == whole[..], "case {i}: head {h} + body {b} bytes");
    }
    let r = poll_fn(|cx| c.poll_send_parts(cx, &[1; 8], &vec![0u8; max - 7])).await;
    assert!(matches!(r, Err(Error::TooLarge { .. })), "{r:?}");
}

#[tokio::test]
async fn full_ring_gives_pending_then_progress() {
    let Some(env) = env() else { return };
    // One credit: 18 receives on the server, 17 send slots on the client.
    let cfg = Config {
        credits: 1,
        ..small_config()
    };
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    let frame_len = c.info().max_frame; // too big to go inline: every send takes a ring slot
    let mut sent = 0u32;
    let mut pending = false;
    // The server does not poll, so the client's sends cannot all retire: it must say Pending.
    for _ in 0..200 {
        let f = pattern(frame_len, sent as u8);
        let r = poll_fn(|cx| Poll::Ready(c.poll_send(cx, &f))).await;
        match r {
            Poll::Ready(Ok(())) => sent += 1,
            Poll::Ready(Err(e)) => panic!("send failed: {e}"),
            Poll::Pending => {
                pending = true;
                break;
            }
        }
    }
    assert!(
        pending,
        "poll_send never returned Pending after {sent} sends"
    );
    assert!((1..200).contains(&sent));
    let total = sent + 50;
    let tx = async move {
        for i in sent..total {
            send(&mut c, &pattern(frame_len, i as u8)).await;
        }
        c
    };
    let rx = async move {
        for i in 0..total {
            let f = frame(&mut s).await;
            assert!(f[..] == pattern(frame_len, i as u8)[..], "frame {i}");
        }
        s
    };
    let (_c, _s) = tokio::join!(tx, rx);
}

#[tokio::test]
async fn rdma_read_in_fragments_with_several_outstanding() {
    let Some(env) = env() else { return };
    let cfg = small_config();
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    // A plain heap buffer (registered on expose) and a pool buffer (the pool's own region).
    let len = 4 << 20;
    let data = pattern(len, 7);
    let exp = s.expose(data.clone()).expect("expose");
    assert!(!exp.zero_copy);
    assert_eq!(
        c.map_remote(&exp.descriptor, len as u64)
            .expect("well-formed"),
        None
    );
    let pool = s.pool().expect("registered pool");
    let mut pb = pool.alloc(300_000).expect("pool alloc");
    pb.copy_from_slice(&pattern(300_000, 9));
    let pooled = pb.freeze();
    let exp2 = s.expose(pooled.clone()).expect("expose pool buffer");

    let frag = 512 << 10;
    let mut dst = c.alloc_recv(len).expect("alloc_recv");
    let n = len / frag;
    let mut dst2 = c.alloc_recv(300_000).expect("alloc_recv");
    let mut reads: Vec<Read> = (0..n)
        .map(|i| {
            // SAFETY: `i * frag` lies inside `dst` (n * frag = len).
            let p = unsafe { dst.as_mut_ptr().add(i * frag) };
            (i as u64, &exp.descriptor[..], (i * frag) as u64, p, frag)
        })
        .collect();
    reads.push((100, &exp2.descriptor[..], 0, dst2.as_mut_ptr(), 300_000));
    // SAFETY: `dst` and `dst2` outlive the call and the link.
    let results = unsafe { read_all(&mut c, &reads) }.await;
    let mut done = vec![false; n + 1];
    for (id, result) in results {
        result.expect("read succeeds");
        let k = if id == 100 { n } else { id as usize };
        assert!(!done[k], "duplicate ReadDone {id}");
        done[k] = true;
    }
    assert!(dst.as_slice() == &data[..], "rendezvous data differs");
    assert!(dst2.as_slice() == &pooled[..], "pool data differs");
    // Exposing the same buffer twice shares one registration; withdrawing one exposure keeps
    // the other readable.
    let again = s.expose(data.clone()).expect("expose again");
    assert!(s.withdraw(exp.id).is_some());
    let mut small = c.alloc_recv(4096).expect("alloc_recv");
    // SAFETY: as above.
    unsafe {
        c.post_read(
            200,
            &again.descriptor,
            (len - 4096) as u64,
            small.as_mut_ptr(),
            4096,
        )
    }
    .expect("post_read");
    match next(&mut c).await.expect("event") {
        LinkEvent::ReadDone { id: 200, result } => {
            result.expect("read through the remaining exposure")
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(small.as_slice() == &data[len - 4096..]);
    assert!(s.withdraw(again.id).is_some());
    assert!(s.withdraw(exp2.id).is_some());
    assert!(s.withdraw(again.id).is_none(), "withdrawn twice");
    // The link still carries frames afterwards.
    send(&mut c, b"done").await;
    assert_eq!(&frame(&mut s).await[..], b"done");
}

/// The link keeps no read queue: the connection schedules reads (`LinkInfo::read_depth`,
/// `max_read`). Past the depth a post is refused at once, not queued or dropped; once one
/// completes there is room again; a read longer than `max_read` is refused too. Every read
/// that was taken completes with the right bytes.
#[tokio::test]
async fn reads_past_the_read_depth_or_max_read_are_refused_and_the_rest_complete() {
    let Some(env) = env() else { return };
    let cfg = small_config();
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    // The depth is bounded by both devices' max_qp_(init_)rd_atom.
    let depth = c.read_depth();
    assert!((1..=16).contains(&depth), "read depth {depth}");
    assert_eq!(c.info().read_depth, depth);
    let max_read = c.info().max_read;
    let (frag, n) = (16 << 10, depth + 1);
    let data = pattern(frag * n, 11);
    let exp = s.expose(data.clone()).expect("expose");
    let mut dst = c.alloc_recv(frag * n).expect("alloc_recv");
    let post = |c: &mut VerbsLink, i: usize, dst: &mut ibex_transport::link::RecvBuf| {
        // SAFETY: `dst` outlives every ReadDone we wait for below and the link.
        unsafe {
            c.post_read(
                i as u64,
                &exp.descriptor,
                (i * frag) as u64,
                dst.as_mut_ptr().add(i * frag),
                frag,
            )
        }
    };
    for i in 0..depth {
        post(&mut c, i, &mut dst).expect("post_read within the depth");
    }
    let e = post(&mut c, depth, &mut dst).expect_err("a read past the depth");
    assert!(e.to_string().contains("read depth"), "{e}");
    let mut big = c.alloc_recv(max_read + 1).expect("alloc_recv");
    let long = pattern(max_read + 1, 12);
    let exp_long = s.expose(long).expect("expose");
    // SAFETY: as above.
    let e = unsafe { c.post_read(999, &exp_long.descriptor, 0, big.as_mut_ptr(), max_read + 1) }
        .expect_err("a read past max_read");
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    let mut done = vec![false; n];
    let mut taken = depth;
    while done.iter().filter(|d| **d).count() < n {
        match next(&mut c).await.expect("event") {
            LinkEvent::ReadDone { id, result } => {
                result.expect("read succeeds");
                assert!(
                    !std::mem::replace(&mut done[id as usize], true),
                    "duplicate ReadDone {id}"
                );
                if taken < n {
                    post(&mut c, taken, &mut dst).expect("room after a completion");
                    taken += 1;
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(dst.as_slice() == &data[..], "read data differs");
}

#[tokio::test]
async fn bad_descriptors_are_errors() {
    let Some(env) = env() else { return };
    let cfg = small_config();
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    let exp = s.expose(Bytes::from(vec![5u8; 8192])).expect("expose");
    let mut dst = c.alloc_recv(8192).expect("alloc_recv");
    // Garbage and out-of-range descriptors fail at once, without touching the QP.
    assert!(c.map_remote(b"garbage", 1).is_err());
    assert!(c.map_remote(&exp.descriptor, 8193).is_err());
    // SAFETY: dst outlives the link's use of it.
    let r = unsafe { c.post_read(1, b"garbage", 0, dst.as_mut_ptr(), 16) };
    assert!(matches!(r, Err(Error::Protocol(_))), "{r:?}");
    // SAFETY: as above.
    let r = unsafe { c.post_read(2, &exp.descriptor, 8000, dst.as_mut_ptr(), 193) };
    assert!(
        matches!(r, Err(Error::Protocol(ref m)) if m.contains("outside")),
        "{r:?}"
    );
    // An unregistered destination is refused.
    let mut heap = vec![0u8; 16];
    // SAFETY: as above.
    let r = unsafe { c.post_read(3, &exp.descriptor, 0, heap.as_mut_ptr(), 16) };
    assert!(r.is_err());
    // A destination larger than the registered receive slab gets its own registration.
    let mut big = c
        .alloc_recv(9 << 20)
        .expect("alloc_recv beyond the receive slab");
    // SAFETY: as above.
    unsafe {
        c.post_read(
            5,
            &exp.descriptor,
            0,
            big.as_mut_ptr().add((9 << 20) - 8192),
            8192,
        )
    }
    .expect("post_read");
    match next(&mut c).await.expect("event") {
        LinkEvent::ReadDone { id: 5, result } => result.expect("read"),
        other => panic!("unexpected {other:?}"),
    }
    assert!(big.as_slice()[(9 << 20) - 8192..].iter().all(|&b| b == 5));
    // A good read still works after the refusals.
    // SAFETY: as above.
    unsafe { c.post_read(4, &exp.descriptor, 0, dst.as_mut_ptr(), 8192) }.expect("post_read");
    match next(&mut c).await.expect("event") {
        LinkEvent::ReadDone { id: 4, result } => result.expect("read"),
        other => panic!("unexpected {other:?}"),
    }
    assert!(dst.as_slice().iter().all(|&b| b == 5));
}

#[tokio::test]
async fn wrong_rkey_fails_the_read_then_the_link() {
    let Some(env) = env() else { return };
    let cfg = small_config();
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    let exp = s.expose(Bytes::from(vec![1u8; 4096])).expect("expose");
    let mut desc = exp.descriptor.to_vec();
    desc[16] ^= 0x5a; // flip bits of the rkey
    let mut dst = c.alloc_recv(4096).expect("alloc_recv");
    // SAFETY: dst outlives the link.
    unsafe { c.post_read(9, &desc, 0, dst.as_mut_ptr(), 4096) }.expect("post_read is accepted");
    match next(&mut c).await {
        Ok(LinkEvent::ReadDone {
            id: 9,
            result: Err(Error::Protocol(m)),
        }) => {
            assert!(m.contains("peer refused the read: bad descriptor"), "{m}");
        }
        other => panic!("expected a refused read, got {other:?}"),
    }
    let after = next(&mut c).await;
    assert!(
        after.is_err(),
        "the link must be reported dead after a refused read, got {after:?}"
    );
    drop(dst);
}

#[tokio::test]
async fn auth_token_mismatch_is_a_clear_error() {
    let Some(env) = env() else { return };
    let sc = Config {
        auth_token: Some("alpha".into()),
        ..small_config()
    };
    let cc = Config {
        auth_token: Some("beta".into()),
        ..small_config()
    };
    let l = verbs::listen_with(&env.listen, &sc, env.server.clone())
        .await
        .expect("listen");
    let addr = l.local_addr().to_string();
    let (s, c) = tokio::join!(
        l.accept(),
        verbs::connect_with(&addr, &cc, env.client.clone())
    );
    for r in [s.map(|_| ()), c.map(|_| ())] {
        let e = r.expect_err("mismatched tokens must fail");
        assert!(e.to_string().contains("IBEX_AUTH_TOKEN"), "{e}");
    }
    // A token on one side only is a mismatch too.
    let none = small_config();
    let (s, c) = tokio::join!(
        l.accept(),
        verbs::connect_with(&addr, &none, env.client.clone())
    );
    assert!(s.is_err() && c.is_err());
    // Matching tokens connect.
    let same = Config {
        auth_token: Some("alpha".into()),
        ..small_config()
    };
    let (s, c) = tokio::join!(
        l.accept(),
        verbs::connect_with(&addr, &same, env.client.clone())
    );
    assert!(s.is_ok() && c.is_ok());
}

#[tokio::test]
async fn close_delivers_what_was_sent_then_peer_sees_it_gone() {
    let Some(env) = env() else { return };
    let cfg = small_config();
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    // The peer must be receiving meanwhile: a link posts only a few receives until bursts
    // make it grow (37 frames and the close marker exceed them), and flushing a closing link
    // waits until the peer's slots took everything.
    let flush = async {
        for i in 0..37u32 {
            send(&mut c, &pattern(100 + i as usize * 50, i as u8)).await;
        }
        c.close();
        tokio::time::timeout(LIMIT, poll_fn(|cx| c.poll_flush(cx)))
            .await
            .expect("flush in time")
            .expect("flush");
    };
    let rx = async {
        for i in 0..37u32 {
            assert!(
                frame(&mut s).await[..] == pattern(100 + i as usize * 50, i as u8)[..],
                "frame {i}"
            );
        }
        let e = next(&mut s).await.expect_err("peer closed");
        // A graceful close: the peer said `BYE` behind its marker.
        assert!(
            matches!(&e, Error::PeerGone(m) if m.ends_with("closed its verbs link")),
            "{e}"
        );
    };
    tokio::join!(flush, rx);
    let r = poll_fn(|cx| c.poll_send(cx, b"late")).await;
    assert!(matches!(r, Err(Error::LocallyClosed)), "{r:?}");
}

/// What a closed and flushed link sent reaches a peer that looks only after the sender's
/// queue pair is gone: its end of file and `BYE` are there before the frames are read, and
/// the peer still delivers every frame up to the close marker, then reports a graceful close.
#[tokio::test]
async fn a_flushed_close_survives_the_sender_dropping_its_queue_pair() {
    let Some(env) = env() else { return };
    let cfg = small_config();
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    // Fewer than the receive slots posted at connect, marker included: no reader needed.
    for i in 0..5u32 {
        send(&mut c, &pattern(700, i as u8)).await;
    }
    c.close();
    tokio::time::timeout(LIMIT, poll_fn(|cx| c.poll_flush(cx)))
        .await
        .expect("flush in time")
        .expect("flush");
    drop(c);
    for i in 0..5u32 {
        assert!(
            frame(&mut s).await[..] == pattern(700, i as u8)[..],
            "frame {i}"
        );
    }
    let e = next(&mut s).await.expect_err("peer closed");
    assert!(
        matches!(&e, Error::PeerGone(m) if m.ends_with("closed its verbs link")),
        "{e}"
    );
}

/// Plays a broken peer: a fresh pair's client writes `bytes` on its bootstrap socket and
/// shuts it, while its queue pair lives on and posts nothing (no close marker). Returns how
/// the server's link ends.
async fn end_after_bootstrap_bytes(env: &Env, bytes: &[u8]) -> Error {
    use std::io::Write;
    let cfg = small_config();
    let (mut s, c) = pair_with(env, &cfg, &cfg).await;
    let fd = c.bootstrap_socket().try_clone_to_owned().expect("dup");
    let mut sock = std::net::TcpStream::from(fd);
    sock.write_all(bytes).expect("write");
    sock.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let e = next(&mut s).await.expect_err("the peer's link is over");
    drop(c);
    e
}

/// A peer that says `BYE` but whose close marker never comes: given up after the wait for
/// the marker (10 s), with an error saying its last frames are lost; not a hang.
#[tokio::test]
async fn a_bye_without_its_marker_is_given_up_in_time() {
    let Some(env) = env() else { return };
    let e = end_after_bootstrap_bytes(&env, &[ibex_transport::verbs_wire::BYE]).await;
    assert!(
        matches!(&e, Error::PeerGone(m) if m.contains("close marker did not arrive")),
        "{e}"
    );
}

/// Anything but one `BYE` on the bootstrap socket after set-up is a protocol error, at once.
#[tokio::test]
async fn a_stray_byte_on_the_bootstrap_socket_is_a_protocol_error() {
    let Some(env) = env() else { return };
    let bye = ibex_transport::verbs_wire::BYE;
    for bytes in [&[0x00][..], &[bye, bye][..]] {
        let e = end_after_bootstrap_bytes(&env, bytes).await;
        assert!(
            matches!(&e, Error::Protocol(m) if m.contains("on the verbs bootstrap connection")),
            "{bytes:?}: {e}"
        );
    }
}

#[tokio::test]
async fn dropped_peer_is_reported_gone() {
    let Some(env) = env() else { return };
    let cfg = small_config();
    let (s, mut c) = pair_with(&env, &cfg, &cfg).await;
    drop(s);
    let e = next(&mut c).await.expect_err("peer dropped");
    assert!(
        matches!(&e, Error::PeerGone(m) if m.contains("without closing the link")),
        "{e}"
    );
}

#[tokio::test]
async fn busy_poll_mode_moves_frames_and_reads() {
    let Some(mut env) = env() else { return };
    env.server.busy_poll = true;
    env.client.busy_poll = true;
    let cfg = small_config();
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    assert!(s.busy_polling() && c.busy_polling());
    for i in 0..50u32 {
        send(&mut c, &pattern(1000, i as u8)).await;
        assert!(frame(&mut s).await[..] == pattern(1000, i as u8)[..]);
    }
    let data = pattern(1 << 20, 3);
    let exp = s.expose(data.clone()).expect("expose");
    let mut dst = c.alloc_recv(1 << 20).expect("alloc_recv");
    // SAFETY: dst outlives the link.
    unsafe { c.post_read(1, &exp.descriptor, 0, dst.as_mut_ptr(), 1 << 20) }.expect("post_read");
    match next(&mut c).await.expect("event") {
        LinkEvent::ReadDone { id: 1, result } => result.expect("read"),
        other => panic!("unexpected {other:?}"),
    }
    assert!(dst.as_slice() == &data[..]);
}

/// Runs where there is no RDMA device (the build host): the error must say what to do.
#[tokio::test]
async fn no_device_is_a_clear_error() {
    if std::env::var("RXE_VM").is_ok() || verbs::device_available() {
        println!("skipped: an RDMA device is present (this test checks the no-device error)");
        return;
    }
    let e = verbs::connect("127.0.0.1:9", &Config::default())
        .await
        .expect_err("no device");
    let m = e.to_string();
    assert!(
        m.contains("no RDMA device found") && m.contains("rdma_rxe") && m.contains("tcp://"),
        "{m}"
    );
    let e = verbs::listen("127.0.0.1:0", &Config::default())
        .await
        .expect_err("no device");
    assert!(e.to_string().contains("no RDMA device found"), "{e}");
}

#[tokio::test]
async fn an_idle_link_holds_few_receive_slots_and_a_burst_grows_them() {
    let Some(env) = env() else { return };
    let cfg = small_config(); // 8 credits: up to 32 receive slots
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    assert!(
        s.recv_slots() <= 8,
        "{} receive slots at connect",
        s.recv_slots()
    );
    assert!(
        c.send_slots() <= 2,
        "{} send slots at connect",
        c.send_slots()
    );
    let tx = async {
        for i in 0..300u32 {
            send(&mut c, &pattern(1000, i as u8)).await;
        }
        c
    };
    let rx = async {
        for i in 0..300u32 {
            assert!(
                frame(&mut s).await[..] == pattern(1000, i as u8)[..],
                "frame {i}"
            );
        }
        s
    };
    let (c, s) = tokio::join!(tx, rx);
    assert!(
        s.recv_slots() > 8 && s.recv_slots() <= 32,
        "{} receive slots after a burst",
        s.recv_slots()
    );
    assert!(
        c.send_slots() > 2,
        "{} send slots after a burst",
        c.send_slots()
    );
}

#[tokio::test]
async fn registrations_outlive_their_exposure_and_the_next_exposure_hits() {
    let Some(env) = env() else { return };
    let cfg = small_config();
    let (mut s, mut c) = pair_with(&env, &cfg, &cfg).await;
    let buf = pattern(256 << 10, 9);
    let first = s.expose(buf.clone()).expect("expose");
    assert_eq!(first.registration, Registration::Registered);
    assert!(s.withdraw(first.id).is_some());
    let again = s.expose(buf.clone()).expect("expose again");
    assert_eq!(
        again.registration,
        Registration::CacheHit,
        "the registration outlived the first exposure"
    );
    // The cached registration still reads the right bytes.
    let mut dst = c.alloc_recv(buf.len()).expect("alloc_recv");
    // SAFETY: `dst` lives until the ReadDone below.
    unsafe {
        c.post_read(1, &again.descriptor, 0, dst.as_mut_ptr(), buf.len())
            .expect("post_read")
    };
    // The server side is polled too (its link must stay alive and quiet meanwhile).
    let ev = tokio::time::timeout(LIMIT, async {
        tokio::select! {
            e = next(&mut c) => e.expect("read"),
            e = next(&mut s) => panic!("server event {:?}", e.map(|_| ())),
        }
    })
    .await
    .expect("read in time");
    assert!(
        matches!(
            ev,
            LinkEvent::ReadDone {
                id: 1,
                result: Ok(())
            }
        ),
        "{ev:?}"
    );
    assert!(dst.as_slice() == &buf[..]);
    s.withdraw(again.id);
    let stats = verbs::registration_stats();
    assert!(
        stats.iter().any(|r| r.cache_hits >= 1),
        "process-wide stats count the hit: {stats:?}"
    );
}
