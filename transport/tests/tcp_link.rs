//! The tcp provider, driven directly through the `Link` trait with `poll_fn`.

use std::future::poll_fn;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use ibex_test_support::pattern;
use ibex_transport::link::{Link, LinkEvent, PushStats, RecvBuf};
use ibex_transport::tcp::{self, TcpLink};
use ibex_transport::{Config, Error};
use tokio::io::AsyncWriteExt;

/// Hang guard only: every test finishes far sooner on a healthy build.
const GUARD: Duration = Duration::from_secs(30);

fn config() -> Config {
    Config {
        pool_size: 1 << 20,
        ..Config::default()
    }
}

async fn pair_with(server: Config, client: Config) -> (TcpLink, TcpLink) {
    let l = tcp::listen("127.0.0.1:0", &server).await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (s, c) = tokio::join!(l.accept(), tcp::connect(&addr, &client));
    (s.unwrap(), c.unwrap())
}

async fn pair() -> (TcpLink, TcpLink) {
    pair_with(config(), config()).await
}

fn frame_len(i: usize, slot: usize) -> usize {
    match i % 500 {
        0 => slot,
        7 => 0,
        13 => slot - 1,
        _ => (i * 7919) % 3000,
    }
}

/// A large buffer filled cheaply: word `k` holds `k ^ seed`.
fn big_region(len: usize, seed: u64) -> Bytes {
    let mut v = vec![0u8; len];
    for (k, w) in v.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&(k as u64 ^ seed).to_le_bytes());
    }
    Bytes::from(v)
}

/// Polls `b` (serving its reads, keeping its events) until `a` has an event.
async fn next_event(
    a: &mut TcpLink,
    b: &mut TcpLink,
    b_events: &mut Vec<LinkEvent>,
) -> Result<LinkEvent, Error> {
    tokio::time::timeout(
        GUARD,
        poll_fn(|cx| {
            while let Poll::Ready(Ok(ev)) = b.poll_event(cx) {
                b_events.push(ev);
            }
            a.poll_event(cx)
        }),
    )
    .await
    .expect("hang guard: no event within 30 s")
}

#[tokio::test]
async fn frames_arrive_in_order_and_intact_both_ways() {
    let (s, c) = pair().await;
    let slot = c.info().max_frame;
    assert_eq!(slot, config().slot_size);
    let mut links = [c, s];
    const N: usize = 3000;
    let (mut sent, mut got) = ([0usize; 2], [0usize; 2]);
    tokio::time::timeout(
        GUARD,
        poll_fn(|cx| {
            for k in 0..2 {
                let [c, s] = &mut links;
                let (tx, rx) = if k == 0 { (c, s) } else { (s, c) };
                // Direction `k` offsets its item indices so the two streams differ.
                while sent[k] < N {
                    let f = pattern(frame_len(sent[k], slot), (sent[k] + k * N) as u8);
                    match tx.poll_send(cx, &f) {
                        Poll::Ready(r) => {
                            r.unwrap();
                            sent[k] += 1;
                        }
                        Poll::Pending => break,
                    }
                }
                if sent[k] == N {
                    let _ = tx.poll_flush(cx);
                }
                while let Poll::Ready(ev) = rx.poll_event(cx) {
                    let LinkEvent::Frame(f) = ev.unwrap() else {
                        panic!("only frames were sent")
                    };
                    assert_eq!(f.len(), frame_len(got[k], slot), "frame {} length", got[k]);
                    assert!(
                        f[..] == pattern(f.len(), (got[k] + k * N) as u8)[..],
                        "frame {} content",
                        got[k]
                    );
                    got[k] += 1;
                }
            }
            if got == [N, N] {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }),
    )
    .await
    .expect("hang guard");
}

#[tokio::test]
async fn oversized_frame_is_refused_before_sending() {
    let small = Config {
        slot_size: 4096,
        ..config()
    };
    let (mut s, mut c) = pair_with(small, config()).await;
    assert_eq!(
        c.info().max_frame,
        4096,
        "max_frame is the peer's slot size"
    );
    assert_eq!(s.info().max_frame, config().slot_size);
    let info = c.info();
    assert_eq!(
        (info.provider, info.rendezvous_path.as_str(), info.one_sided),
        ("tcp", "tcp-stream", false)
    );
    assert!(info.peer.starts_with("127.0.0.1:"), "{}", info.peer);
    let e = poll_fn(|cx| c.poll_send(cx, &[0u8; 4097]))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::TooLarge {
                len: 4097,
                limit: 4096,
                ..
            }
        ),
        "{e}"
    );
    // The link is still fine for frames that fit.
    poll_fn(|cx| c.poll_send(cx, &[1u8; 4096])).await.unwrap();
    let mut ignored = Vec::new();
    let LinkEvent::Frame(f) = next_event(&mut s, &mut c, &mut ignored).await.unwrap() else {
        panic!()
    };
    assert_eq!(&f[..], &[1u8; 4096][..]);
}

#[tokio::test]
async fn reads_interleave_with_frames() {
    let (mut s, mut c) = pair().await;
    let region = big_region(4 << 20, 7);
    let exp = s.expose(region.clone()).unwrap();
    assert!(!exp.zero_copy);
    assert_eq!(
        s.map_remote(&exp.descriptor, region.len() as u64).unwrap(),
        None
    );
    let mut dst = c.alloc_recv(region.len()).unwrap();
    const FRAG: usize = 64 << 10;
    let frags = region.len() / FRAG;
    let (mut posted, mut done, mut frames_to_s, mut frames_to_c, mut s_got, mut c_got) =
        (0, 0, 0, 0, 0, 0);
    let mut s_events = Vec::new();
    tokio::time::timeout(
        GUARD,
        poll_fn(|cx| {
            let before = (posted, done, frames_to_s, frames_to_c, s_got, c_got);
            // Up to 4 reads outstanding, with frames both ways between them.
            while posted < frags && posted - done < 4 {
                // SAFETY: `dst` outlives both links' use of it (every ReadDone arrives before
                // the test ends), and fragments do not overlap.
                unsafe {
                    let p = dst.as_mut_ptr().add(posted * FRAG);
                    c.post_read(
                        posted as u64,
                        &exp.descriptor,
                        (posted * FRAG) as u64,
                        p,
                        FRAG,
                    )
                    .unwrap();
                }
                posted += 1;
            }
            while frames_to_s < 2 * posted {
                match c.poll_send(cx, &pattern(100 + frames_to_s, frames_to_s as u8)) {
                    Poll::Ready(r) => {
                        r.unwrap();
                        frames_to_s += 1;
                    }
                    Poll::Pending => break,
                }
            }
            while frames_to_c < 2 * posted {
                match s.poll_send(cx, &pattern(50 + frames_to_c, (frames_to_c + 9) as u8)) {
                    Poll::Ready(r) => {
                        r.unwrap();
                        frames_to_c += 1;
                    }
                    Poll::Pending => break,
                }
            }
            let _ = c.poll_flush(cx);
            let _ = s.poll_flush(cx);
            while let Poll::Ready(ev) = s.poll_event(cx) {
                s_events.push(ev.unwrap());
            }
            while let Poll::Ready(ev) = c.poll_event(cx) {
                match ev.unwrap() {
                    LinkEvent::Frame(f) => {
                        assert_eq!(f[..], pattern(50 + c_got, (c_got + 9) as u8)[..]);
                        c_got += 1;
                    }
                    LinkEvent::ReadDone { id, result } => {
                        result.unwrap();
                        assert_eq!(id, done as u64, "completions come back in request order");
                        done += 1;
                    }
                }
            }
            for ev in s_events.drain(..) {
                let LinkEvent::Frame(f) = ev else {
                    panic!("serving reads must not surface events")
                };
                assert_eq!(f[..], pattern(100 + s_got, s_got as u8)[..]);
                s_got += 1;
            }
            if done == frags && s_got == 2 * frags && c_got == 2 * frags {
                return Poll::Ready(());
            }
            // Completions may allow new posts that no socket event would wake us for.
            if before != (posted, done, frames_to_s, frames_to_c, s_got, c_got) {
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        }),
    )
    .await
    .expect("hang guard");
    assert!(
        dst.as_slice() == &region[..],
        "read data differs from the exposed region"
    );
    assert_eq!(s.withdraw(exp.id), Some(region));
}

/// Reads `len` bytes of `desc` in `frag`-sized pieces with `depth` outstanding.
async fn read_all(
    c: &mut TcpLink,
    s: &mut TcpLink,
    desc: &[u8],
    len: usize,
    frag: usize,
    depth: usize,
) -> RecvBuf {
    let mut dst = c.alloc_recv(len).unwrap();
    let n = len.div_ceil(frag);
    let (mut posted, mut done) = (0, 0);
    let mut s_events = Vec::new();
    while done < n {
        while posted < n && posted - done < depth {
            let off = posted * frag;
            let l = frag.min(len - off);
            // SAFETY: `dst` lives until after the last ReadDone; pieces do not overlap.
            unsafe {
                c.post_read(
                    posted as u64,
                    desc,
                    off as u64,
                    dst.as_mut_ptr().add(off),
                    l,
                )
                .unwrap()
            };
            posted += 1;
        }
        let LinkEvent::ReadDone { id, result } = next_event(c, s, &mut s_events).await.unwrap()
        else {
            panic!("no frames were sent")
        };
        result.unwrap();
        assert_eq!(id, done as u64);
        done += 1;
    }
    assert!(
        s_events.is_empty(),
        "serving reads must not surface events: {s_events:?}"
    );
    dst
}

#[tokio::test]
async fn reads_of_64_mib_in_fragments_and_whole() {
    let (mut s, mut c) = pair().await;
    let len = 64 << 20;
    let region = big_region(len, 0x5eed);
    let exp = s.expose(region.clone()).unwrap();
    let dst = read_all(&mut c, &mut s, &exp.descriptor, len, 512 << 10, 8).await;
    assert!(dst.as_slice() == &region[..], "fragmented read differs");
    drop(dst);
    // The largest single request, then an odd fragment size whose last piece is short.
    let dst = read_all(&mut c, &mut s, &exp.descriptor, len, len, 1).await;
    assert!(dst.as_slice() == &region[..], "whole read differs");
    let dst = read_all(&mut c, &mut s, &exp.descriptor, 3 << 20, 300_001, 3).await;
    assert!(
        dst.as_slice() == &region[..3 << 20],
        "odd-fragment read differs"
    );
}

fn descriptor(region: u64, len: u64) -> Vec<u8> {
    let mut d = region.to_le_bytes().to_vec();
    d.extend_from_slice(&len.to_le_bytes());
    d
}

#[tokio::test]
async fn bad_descriptors_fail_the_read_and_the_link_stays_usable() {
    let (mut s, mut c) = pair().await;
    let region = pattern(10_000, 1);
    let exp = s.expose(region.clone()).unwrap();
    let mut dst = c.alloc_recv(20_000).unwrap();
    let p = dst.as_mut_ptr();

    // Checked locally against the descriptor: garbage, out of range, over the request limit.
    // SAFETY (every post_read below): `dst` outlives the links' use of it.
    let e = unsafe { c.post_read(1, b"junk", 0, p, 10) }.unwrap_err();
    assert!(e.to_string().contains("descriptor"), "{e}");
    assert!(c.map_remote(b"junk", 10).is_err());
    assert!(c.map_remote(&exp.descriptor, 10_001).is_err());
    let e = unsafe { c.post_read(2, &exp.descriptor, 9_000, p, 1_001) }.unwrap_err();
    assert!(e.to_string().contains("outside region"), "{e}");
    let e = unsafe { c.post_read(3, &exp.descriptor, u64::MAX, p, 2) }.unwrap_err();
    assert!(e.to_string().contains("outside region"), "{e}");
    let e =
        unsafe { c.post_read(4, &descriptor(exp.id, 1 << 40), 0, p, (64 << 20) + 1) }.unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");

    // Checked by the serving side: a descriptor that lies about the length, an unknown region.
    let mut s_events = Vec::new();
    unsafe { c.post_read(10, &descriptor(exp.id, 20_000), 5_000, p, 15_000) }.unwrap();
    unsafe { c.post_read(11, &descriptor(999, 100), 0, p, 100) }.unwrap();
    unsafe { c.post_read(12, &exp.descriptor, 0, p, 10_000) }.unwrap();
    let ev = next_event(&mut c, &mut s, &mut s_events).await.unwrap();
    let LinkEvent::ReadDone {
        id: 10,
        result: Err(e),
    } = ev
    else {
        panic!("{ev:?}")
    };
    assert!(e.to_string().contains("outside region"), "{e}");
    let ev = next_event(&mut c, &mut s, &mut s_events).await.unwrap();
    let LinkEvent::ReadDone {
        id: 11,
        result: Err(e),
    } = ev
    else {
        panic!("{ev:?}")
    };
    assert!(e.to_string().contains("unknown region 999"), "{e}");
    let ev = next_event(&mut c, &mut s, &mut s_events).await.unwrap();
    assert!(
        matches!(
            ev,
            LinkEvent::ReadDone {
                id: 12,
                result: Ok(())
            }
        ),
        "{ev:?}"
    );
    assert!(dst.as_slice()[..10_000] == region[..]);

    // A withdrawn region can no longer be read.
    assert_eq!(s.withdraw(exp.id), Some(region));
    unsafe { c.post_read(13, &exp.descriptor, 0, p, 10) }.unwrap();
    let ev = next_event(&mut c, &mut s, &mut s_events).await.unwrap();
    let LinkEvent::ReadDone {
        id: 13,
        result: Err(e),
    } = ev
    else {
        panic!("{ev:?}")
    };
    assert!(e.to_string().contains("withdrawn"), "{e}");
    assert!(s_events.is_empty());
}

/// After the peer is gone: the reads failed with `PeerGone`, in order, then the link's error.
async fn fail_out(link: &mut TcpLink) -> (Vec<u64>, Error) {
    let mut failed = Vec::new();
    let last = tokio::time::timeout(GUARD, async {
        loop {
            match poll_fn(|cx| link.poll_event(cx)).await {
                Ok(LinkEvent::ReadDone {
                    id,
                    result: Err(Error::PeerGone(_)),
                }) => failed.push(id),
                Ok(other) => panic!("unexpected {other:?}"),
                Err(e) => return e,
            }
        }
    })
    .await
    .expect("hang guard");
    (failed, last)
}

#[tokio::test]
async fn peer_dropped_mid_read_fails_every_read_then_the_link() {
    let (mut s, mut c) = pair().await;
    let len = 32 << 20;
    let exp = s.expose(big_region(len, 3)).unwrap();
    let mut dst = c.alloc_recv(len).unwrap();
    let p = dst.as_mut_ptr();
    // SAFETY: `dst` outlives `c`, which is dropped at the end of the test.
    unsafe {
        c.post_read(1, &exp.descriptor, 0, p, len).unwrap();
        c.post_read(2, &exp.descriptor, 0, p, 16).unwrap();
    }
    // Let the server start serving and the client start receiving, then kill the server.
    poll_fn(|cx| {
        let _ = s.poll_event(cx);
        if s.bytes_queued() > 0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    poll_fn(|cx| {
        assert!(
            c.poll_event(cx).is_pending(),
            "the response cannot be complete yet"
        );
        Poll::Ready(())
    })
    .await;
    assert_eq!(c.reads_outstanding(), 2);
    drop(s);
    let (failed, last) = fail_out(&mut c).await;
    assert_eq!(failed, [1, 2]);
    assert!(matches!(last, Error::PeerGone(_)), "{last}");
    // The link stays dead and says so.
    assert!(poll_fn(|cx| c.poll_send(cx, b"x")).await.is_err());
    // SAFETY: as above.
    assert!(unsafe { c.post_read(3, &exp.descriptor, 0, p, 16) }.is_err());
}

/// Counts wake-ups.
struct CountingWaker(std::sync::atomic::AtomicUsize);

impl std::task::Wake for CountingWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_frame_left_unwritten_wakes_the_sender_and_goes_out_with_the_next_poll() {
    let (mut s, mut c) = pair().await;
    let counter = std::sync::Arc::new(CountingWaker(0.into()));
    let waker = std::task::Waker::from(counter.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(c.poll_send(&mut cx, b"small").is_ready());
    assert_eq!(
        c.bytes_queued(),
        5 + 5,
        "a small frame waits to share a writev"
    );
    assert!(
        counter.0.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the sender's task was woken"
    );
    // The sender only ever waits for events: that alone must push the frame out.
    assert!(c.poll_event(&mut cx).is_pending());
    assert_eq!(c.bytes_queued(), 0);
    let mut ignored = Vec::new();
    let LinkEvent::Frame(f) = next_event(&mut s, &mut c, &mut ignored).await.unwrap() else {
        panic!()
    };
    assert_eq!(&f[..], b"small");
}

#[tokio::test]
async fn close_delivers_what_was_sent_then_end_of_stream() {
    let (mut s, mut c) = pair().await;
    for i in 0..3 {
        poll_fn(|cx| c.poll_send(cx, &pattern(1000, i as u8)))
            .await
            .unwrap();
    }
    c.close();
    assert!(matches!(
        poll_fn(|cx| c.poll_send(cx, b"late")).await,
        Err(Error::LocallyClosed)
    ));
    let mut ignored = Vec::new();
    for i in 0..3 {
        let LinkEvent::Frame(f) = next_event(&mut s, &mut c, &mut ignored).await.unwrap() else {
            panic!()
        };
        assert_eq!(f[..], pattern(1000, i as u8)[..]);
    }
    let e = next_event(&mut s, &mut c, &mut ignored).await.unwrap_err();
    assert!(
        matches!(e, Error::PeerGone(ref m) if m.contains("closed the connection")),
        "{e}"
    );
}

#[tokio::test]
async fn reads_unanswered_by_a_closing_peer_fail_at_end_of_stream() {
    let (mut s, mut c) = pair().await;
    let exp = s.expose(Bytes::from(vec![1u8; 1000])).unwrap();
    let mut dst = c.alloc_recv(1000).unwrap();
    // SAFETY: `dst` outlives `c`.
    unsafe { c.post_read(1, &exp.descriptor, 0, dst.as_mut_ptr(), 1000) }.unwrap();
    s.close();
    let mut s_events = Vec::new();
    let ev = next_event(&mut c, &mut s, &mut s_events).await.unwrap();
    assert!(
        matches!(
            ev,
            LinkEvent::ReadDone {
                id: 1,
                result: Err(Error::PeerGone(_))
            }
        ),
        "{ev:?}"
    );
    let e = next_event(&mut c, &mut s, &mut s_events).await.unwrap_err();
    assert!(matches!(e, Error::PeerGone(_)), "{e}");
    assert!(s_events.is_empty());
}

#[tokio::test]
async fn pool_is_plain_memory_of_the_configured_size() {
    let (s, _c) = pair().await;
    let pool = s.pool().expect("tcp offers a heap pool");
    assert_eq!(pool.size(), 1 << 20);
    assert!(
        std::sync::Arc::ptr_eq(&pool, &s.pool().unwrap()),
        "created once"
    );
}

/// Accepts one connection from a raw socket that writes `bytes` first.
async fn accept_raw(bytes: &[u8]) -> Error {
    let l = tcp::listen("127.0.0.1:0", &config()).await.unwrap();
    let addr = l.local_addr().unwrap();
    let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
    raw.write_all(bytes).await.unwrap();
    let e = tokio::time::timeout(GUARD, l.accept())
        .await
        .expect("hang guard")
        .unwrap_err();
    drop(raw);
    e
}

fn raw_preface(version: u16, slot: u32, token: &[u8]) -> Vec<u8> {
    use ibex_transport::preface::{Preface, Provider};
    let mut v = Preface {
        slot_size: slot,
        features: 0,
        token: token.to_vec(),
        ext: Vec::new(),
    }
    .encode(Provider::Tcp);
    v[8..10].copy_from_slice(&version.to_le_bytes());
    v
}

#[tokio::test]
async fn garbage_preface_is_a_clear_error_on_accept() {
    let e = accept_raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(
        matches!(e, Error::Handshake(ref m) if m.contains("not an Ibex tcp endpoint")),
        "{e}"
    );
    let e = accept_raw(&raw_preface(99, 65536, b"")).await;
    assert!(
        matches!(e, Error::Handshake(ref m) if m.contains("version 99, we speak 2")),
        "{e}"
    );
    let e = accept_raw(&raw_preface(2, 1 << 30, b"")).await;
    assert!(
        matches!(e, Error::Handshake(ref m) if m.contains("slot size")),
        "{e}"
    );
}

#[tokio::test(start_paused = true)]
async fn silent_client_times_out_setup() {
    let e = accept_raw(b"").await;
    assert!(
        matches!(e, Error::Timeout(ref m) if m.contains("preface")),
        "{e}"
    );
}

/// A server link whose client is a raw socket that sent a valid preface.
async fn raw_client() -> (TcpLink, tokio::net::TcpStream) {
    let l = tcp::listen("127.0.0.1:0", &config()).await.unwrap();
    let mut raw = tokio::net::TcpStream::connect(l.local_addr().unwrap())
        .await
        .unwrap();
    raw.write_all(&raw_preface(2, 65536, b"")).await.unwrap();
    (l.accept().await.unwrap(), raw)
}

#[tokio::test]
async fn hostile_records_are_protocol_errors_not_allocations() {
    let cases: [(&[u8], &str); 4] = [
        (&[0, 0xff, 0xff, 0xff, 0x7f], "exceeds the limit"),
        (&[2, 0xff, 0xff, 0xff, 0x7f], "read response record"),
        (&[9, 0, 0, 0, 0], "unknown tcp record type 9"),
        (&[1, 3, 0, 0, 0], "read request of 3 bytes"),
    ];
    for (record, want) in cases {
        let (mut s, mut raw) = raw_client().await;
        raw.write_all(record).await.unwrap();
        let e = own_event(&mut s).await.unwrap_err();
        assert!(
            matches!(e, Error::Protocol(ref m) if m.contains(want)),
            "{want}: {e}"
        );
    }
    // A response nobody asked for.
    let (mut s, mut raw) = raw_client().await;
    let mut rec = vec![2, 13, 0, 0, 0];
    rec.extend_from_slice(&5u64.to_le_bytes());
    rec.extend_from_slice(&[0, 0, 0, 0, 0]);
    raw.write_all(&rec).await.unwrap();
    let e = own_event(&mut s).await.unwrap_err();
    assert!(
        matches!(e, Error::Protocol(ref m) if m.contains("no read is outstanding")),
        "{e}"
    );
}

#[tokio::test]
async fn auth_tokens_must_match() {
    let with = |t: &str| Config {
        auth_token: Some(t.into()),
        ..config()
    };
    let (s, c) = pair_with(with("s3cret"), with("s3cret")).await;
    drop((s, c));

    for (server, client) in [
        (with("s3cret"), with("other")),
        (with("s3cret"), config()),
        (config(), with("x")),
    ] {
        let l = tcp::listen("127.0.0.1:0", &server).await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (s, c) = tokio::join!(l.accept(), tcp::connect(&addr, &client));
        for e in [s.unwrap_err(), c.unwrap_err()] {
            assert!(
                matches!(e, Error::Handshake(ref m) if m.contains("IBEX_AUTH_TOKEN")),
                "{e}"
            );
        }
    }
}

#[tokio::test]
async fn refused_connection_names_the_address() {
    let l = tcp::listen("127.0.0.1:0", &config()).await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let e = tcp::connect(&addr, &config()).await.unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains(&addr) && m.contains("nothing listens") && m.contains("is the server running"),
        "{m}"
    );
    let e = tcp::connect("no-port-here", &config()).await.unwrap_err();
    assert!(matches!(e, Error::Address { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_on_separate_tasks_serve_and_read() {
    let (mut s, mut c) = pair().await;
    let region = big_region(8 << 20, 11);
    let exp = s.expose(region.clone()).unwrap();
    // The server is a driver that only waits for events: serving happens inside them.
    let server = tokio::spawn(async move {
        let mut frames = Vec::new();
        let end = poll_fn(|cx| {
            loop {
                match s.poll_event(cx) {
                    Poll::Ready(Ok(LinkEvent::Frame(f))) => frames.push(f),
                    Poll::Ready(Ok(other)) => panic!("unexpected {other:?}"),
                    Poll::Ready(Err(e)) => return Poll::Ready(e),
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .await;
        (frames, end)
    });
    let dst = tokio::time::timeout(GUARD, async {
        let mut dst = c.alloc_recv(region.len()).unwrap();
        let frag = 512 << 10;
        let n = region.len() / frag;
        let (mut posted, mut done) = (0, 0);
        poll_fn(|cx| {
            loop {
                while posted < n && posted - done < 8 {
                    // SAFETY: `dst` outlives every read; fragments do not overlap.
                    unsafe {
                        let p = dst.as_mut_ptr().add(posted * frag);
                        c.post_read(
                            posted as u64,
                            &exp.descriptor,
                            (posted * frag) as u64,
                            p,
                            frag,
                        )
                        .unwrap();
                    }
                    posted += 1;
                }
                match c.poll_event(cx) {
                    Poll::Ready(Ok(LinkEvent::ReadDone { id, result })) => {
                        result.unwrap();
                        assert_eq!(id, done as u64);
                        done += 1;
                        if done == n {
                            return Poll::Ready(());
                        }
                    }
                    Poll::Ready(other) => panic!("unexpected {other:?}"),
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .await;
        for i in 0..100 {
            poll_fn(|cx| c.poll_send(cx, &pattern(i * 10, i as u8)))
                .await
                .unwrap();
        }
        poll_fn(|cx| c.poll_flush(cx)).await.unwrap();
        c.close();
        dst
    })
    .await
    .expect("hang guard");
    assert!(dst.as_slice() == &region[..]);
    let (frames, end) = tokio::time::timeout(GUARD, server)
        .await
        .expect("hang guard")
        .unwrap();
    assert_eq!(frames.len(), 100);
    for (i, f) in frames.iter().enumerate() {
        assert_eq!(f[..], pattern(i * 10, i as u8)[..]);
    }
    assert!(matches!(end, Error::PeerGone(_)), "{end}");
}

/// The link's next event, with nobody else polled.
async fn own_event(link: &mut TcpLink) -> Result<LinkEvent, Error> {
    tokio::time::timeout(GUARD, poll_fn(|cx| link.poll_event(cx)))
        .await
        .expect("hang guard")
}

/// Sends one frame and writes what the socket takes now; the rest goes out as the link is
/// polled (pushes behind it may not fit the socket before the peer reads).
async fn send_frame(link: &mut TcpLink, frame: &[u8]) {
    poll_fn(|cx| link.poll_send(cx, frame)).await.unwrap();
    poll_fn(|cx| match link.poll_flush(cx) {
        Poll::Ready(r) => {
            r.unwrap();
            Poll::Ready(())
        }
        Poll::Pending => Poll::Ready(()),
    })
    .await;
}

/// Polls both links until `done(a)` holds.
async fn poll_until(a: &mut TcpLink, b: &mut TcpLink, done: impl Fn(&TcpLink) -> bool) {
    tokio::time::timeout(
        GUARD,
        poll_fn(|cx| {
            if let Poll::Ready(ev) = b.poll_event(cx) {
                panic!("unexpected event on the owner: {ev:?}");
            }
            if let Poll::Ready(ev) = a.poll_event(cx) {
                panic!("unexpected event on the reader: {ev:?}");
            }
            if done(a) {
                Poll::Ready(())
            } else {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }),
    )
    .await
    .expect("hang guard");
}

/// Takes `n` read completions on `c`, in order, each a success.
async fn completions(c: &mut TcpLink, s: &mut TcpLink, n: usize) -> Vec<u64> {
    let mut s_events = Vec::new();
    let mut ids = Vec::new();
    while ids.len() < n {
        match next_event(c, s, &mut s_events).await.unwrap() {
            LinkEvent::ReadDone { id, result } => {
                result.unwrap();
                ids.push(id);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(s_events.is_empty(), "{s_events:?}");
    ids
}

fn flagged(desc: &[u8]) -> bool {
    desc[7] & 0x80 != 0
}

#[tokio::test]
async fn pushed_bodies_fill_reads_posted_before_they_arrive() {
    let (mut s, mut c) = pair().await;
    let one = big_region(100_000, 1);
    let two = big_region(tcp::wire::MAX_PUSH, 2);
    assert_eq!(
        s.info().max_push,
        tcp::wire::MAX_PUSH,
        "the peer takes pushes"
    );
    let e1 = s.expose_pushed(one.clone()).unwrap();
    let e2 = s.expose_pushed(two.clone()).unwrap();
    assert!(flagged(&e1.descriptor) && flagged(&e2.descriptor));
    // Nothing goes before the frame that follows the exposure (the RTS, in a connection).
    poll_fn(|cx| s.poll_flush(cx)).await.unwrap();
    assert_eq!(s.bytes_queued(), 0);
    assert_eq!(s.push_stats().sent, 0);
    let mut d1 = c.alloc_recv(one.len()).unwrap();
    let mut d2 = c.alloc_recv(two.len()).unwrap();
    const FRAG: usize = 512 << 10;
    // SAFETY: both buffers outlive the reads (all complete below); pieces do not overlap.
    unsafe {
        c.post_read(1, &e1.descriptor, 0, d1.as_mut_ptr(), one.len())
            .unwrap();
        for k in 0..two.len() / FRAG {
            let p = d2.as_mut_ptr().add(k * FRAG);
            c.post_read(10 + k as u64, &e2.descriptor, (k * FRAG) as u64, p, FRAG)
                .unwrap();
        }
    }
    assert_eq!(c.reads_outstanding(), 5);
    send_frame(&mut s, b"rts").await;
    let ev = next_event(&mut c, &mut s, &mut Vec::new()).await.unwrap();
    assert!(
        matches!(ev, LinkEvent::Frame(ref f) if &f[..] == b"rts"),
        "{ev:?}"
    );
    assert_eq!(completions(&mut c, &mut s, 5).await, [1, 10, 11, 12, 13]);
    assert!(d1.as_slice() == &one[..] && d2.as_slice() == &two[..]);
    assert_eq!(
        c.push_stats(),
        PushStats {
            direct: 2,
            ..Default::default()
        },
        "no read asked the owner"
    );
    assert_eq!(s.push_stats().sent, 2);
    assert_eq!(c.reads_outstanding(), 0);
}

#[tokio::test]
async fn pushes_that_arrive_before_their_reads_are_held_then_copied_out() {
    let (mut s, mut c) = pair().await;
    let region = big_region(300_000, 3);
    let e = s.expose_pushed(region.clone()).unwrap();
    send_frame(&mut s, b"rts").await;
    let ev = next_event(&mut c, &mut s, &mut Vec::new()).await.unwrap();
    assert!(matches!(ev, LinkEvent::Frame(_)));
    poll_until(&mut c, &mut s, |c| c.pushes_held() == 1).await;
    let mut dst = c.alloc_recv(region.len()).unwrap();
    // SAFETY: `dst` outlives the reads; the two halves do not overlap.
    unsafe {
        c.post_read(1, &e.descriptor, 0, dst.as_mut_ptr(), 100_000)
            .unwrap();
        let p = dst.as_mut_ptr().add(100_000);
        c.post_read(2, &e.descriptor, 100_000, p, 200_000).unwrap();
    }
    assert_eq!(completions(&mut c, &mut s, 2).await, [1, 2]);
    assert!(dst.as_slice() == &region[..]);
    assert_eq!(c.pushes_held(), 0, "a push is let go once read whole");
    // A second read of the region asks the owner, which still exposes it.
    let mut again = c.alloc_recv(1000).unwrap();
    // SAFETY: as above.
    unsafe { c.post_read(3, &e.descriptor, 5000, again.as_mut_ptr(), 1000) }.unwrap();
    assert_eq!(completions(&mut c, &mut s, 1).await, [3]);
    assert!(again.as_slice() == &region[5000..6000]);
    assert_eq!(
        c.push_stats(),
        PushStats {
            held: 1,
            asked: 1,
            ..Default::default()
        }
    );
}

#[tokio::test]
async fn pushes_past_the_hold_limit_are_dropped_and_read_the_usual_way() {
    let (mut s, mut c) = pair().await;
    let n = tcp::wire::MAX_HELD / tcp::wire::MAX_PUSH + 1;
    let regions: Vec<Bytes> = (0..n)
        .map(|i| big_region(tcp::wire::MAX_PUSH, i as u64))
        .collect();
    let exps: Vec<_> = regions
        .iter()
        .map(|r| s.expose_pushed(r.clone()).unwrap())
        .collect();
    send_frame(&mut s, b"rts").await;
    let ev = next_event(&mut c, &mut s, &mut Vec::new()).await.unwrap();
    assert!(matches!(ev, LinkEvent::Frame(_)));
    poll_until(&mut c, &mut s, |c| {
        c.pushes_held() == n - 1 && c.push_stats().dropped == 1
    })
    .await;
    let mut dsts: Vec<RecvBuf> = regions
        .iter()
        .map(|r| c.alloc_recv(r.len()).unwrap())
        .collect();
    for (i, (e, d)) in exps.iter().zip(dsts.iter_mut()).enumerate() {
        // SAFETY: the buffers outlive the reads.
        unsafe { c.post_read(i as u64, &e.descriptor, 0, d.as_mut_ptr(), d.len()) }.unwrap();
    }
    let mut ids = completions(&mut c, &mut s, n).await;
    ids.sort_unstable();
    assert_eq!(ids, (0..n as u64).collect::<Vec<_>>());
    for (r, d) in regions.iter().zip(&dsts) {
        assert!(d.as_slice() == &r[..]);
    }
    assert_eq!(
        c.push_stats(),
        PushStats {
            held: n as u64 - 1,
            dropped: 1,
            asked: 1,
            ..Default::default()
        }
    );
}

#[tokio::test]
async fn nothing_is_pushed_to_a_peer_that_does_not_take_pushes() {
    let (mut s, mut raw) = raw_client().await;
    skip_preface(&mut raw).await;
    assert_eq!(s.info().max_push, 0, "so the core asks for no push");
    // Asked all the same, the link still writes no push the peer would refuse.
    let e = s.expose_pushed(pattern(5000, 1)).unwrap();
    assert!(!flagged(&e.descriptor));
    send_frame(&mut s, b"rts").await;
    let mut got = vec![0u8; 8];
    use tokio::io::AsyncReadExt;
    raw.read_exact(&mut got).await.unwrap();
    assert_eq!(got, [0, 3, 0, 0, 0, b'r', b't', b's']);
    let more = tokio::time::timeout(Duration::from_millis(100), raw.read(&mut got)).await;
    assert!(more.is_err(), "nothing follows the frame: {more:?}");
    assert_eq!(s.push_stats().sent, 0);
}

/// Reads the link's own preface off the raw peer's socket.
async fn skip_preface(raw: &mut tokio::net::TcpStream) {
    use tokio::io::AsyncReadExt;
    let mut p = [0u8; ibex_transport::preface::FIXED_LEN];
    raw.read_exact(&mut p).await.unwrap();
    assert_eq!(&p[..8], b"IBEXTCP\0");
}

fn push_record(region: u64, claimed: u32, payload: &[u8]) -> Vec<u8> {
    let mut r = vec![3];
    r.extend_from_slice(&(12 + payload.len() as u32).to_le_bytes());
    r.extend_from_slice(&region.to_le_bytes());
    r.extend_from_slice(&claimed.to_le_bytes());
    r.extend_from_slice(payload);
    r
}

#[tokio::test]
async fn hostile_pushes_are_protocol_errors() {
    let mut out_of_order = push_record(5, 4, b"abcd");
    out_of_order.extend(push_record(5, 4, b"abcd"));
    let cases: [(Vec<u8>, &str); 5] = [
        (vec![3, 12, 0, 0, 0], "push record of 12 bytes is outside"),
        (vec![3, 0xff, 0xff, 0xff, 0x7f], "push record of"),
        (
            push_record(1, 10, b"abcd"),
            "claims 10 bytes in a record carrying 4",
        ),
        (out_of_order, "pushes must come in exposure order"),
        (push_record(1 << 63, 4, b"abcd"), "exposure order"),
    ];
    for (record, want) in cases {
        let (mut s, mut raw) = raw_client().await;
        raw.write_all(&record).await.unwrap();
        let e = own_event(&mut s).await.unwrap_err();
        assert!(
            matches!(e, Error::Protocol(ref m) if m.contains(want)),
            "{want}: {e}"
        );
    }
}

#[tokio::test]
async fn a_marked_region_never_pushed_is_asked_for_once_a_later_push_comes() {
    use tokio::io::AsyncReadExt;
    let (mut s, mut raw) = raw_client().await;
    skip_preface(&mut raw).await;
    let mut dst = vec![0u8; 100];
    // SAFETY: `dst` outlives `s`'s use of it (the read fails before the test ends).
    unsafe { s.post_read(7, &descriptor(3 | 1 << 63, 100), 0, dst.as_mut_ptr(), 100) }.unwrap();
    raw.write_all(&push_record(4, 4, b"abcd")).await.unwrap();
    tokio::time::timeout(
        GUARD,
        poll_fn(|cx| {
            assert!(s.poll_event(cx).is_pending());
            if s.push_stats().asked == 1 {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }),
    )
    .await
    .expect("hang guard");
    poll_fn(|cx| s.poll_flush(cx)).await.unwrap();
    let mut req = [0u8; 33];
    raw.read_exact(&mut req).await.unwrap();
    assert_eq!(req[0], 1, "a read request");
    assert_eq!(&req[13..21], &3u64.to_le_bytes(), "for the region itself");
    // The peer refuses it: the read fails, the link goes on.
    let mut resp = vec![2, 13 + 4, 0, 0, 0];
    resp.extend_from_slice(&7u64.to_le_bytes());
    resp.extend_from_slice(&[1, 4, 0, 0, 0]);
    resp.extend_from_slice(b"nope");
    raw.write_all(&resp).await.unwrap();
    let ev = own_event(&mut s).await.unwrap();
    assert!(
        matches!(ev, LinkEvent::ReadDone { id: 7, result: Err(Error::Protocol(ref m)) } if m.contains("nope")),
        "{ev:?}"
    );
}

#[tokio::test]
async fn a_peer_gone_in_the_middle_of_a_push_fails_its_reads_then_the_link() {
    let (mut s, mut raw) = raw_client().await;
    skip_preface(&mut raw).await;
    let mut dst = vec![0u8; 1000];
    let p = dst.as_mut_ptr();
    // SAFETY: `dst` outlives `s`'s use of it (the reads fail before the test ends).
    unsafe {
        s.post_read(1, &descriptor(1 | 1 << 63, 1000), 0, p, 600)
            .unwrap();
        s.post_read(2, &descriptor(1 | 1 << 63, 1000), 600, p.add(600), 400)
            .unwrap();
    }
    let mut rec = push_record(1, 1000, &[7; 500]);
    rec[1..5].copy_from_slice(&(12u32 + 1000).to_le_bytes());
    raw.write_all(&rec).await.unwrap();
    drop(raw);
    let (failed, last) = fail_out(&mut s).await;
    assert_eq!(failed, [1, 2]);
    assert!(
        matches!(last, Error::PeerGone(ref m) if m.contains("pushed region")),
        "{last}"
    );
}

/// Polls `s` (whose peer is a raw socket) until `done`, failing on any event.
async fn poll_raw_until(s: &mut TcpLink, done: impl Fn(&TcpLink) -> bool) {
    tokio::time::timeout(
        GUARD,
        poll_fn(|cx| {
            assert!(s.poll_event(cx).is_pending(), "no event was expected");
            if done(s) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }),
    )
    .await
    .expect("hang guard");
}

/// Writes `bytes` from a task of its own, so the link can be polled meanwhile (more than
/// the sockets hold would otherwise block the test).
fn write_behind(
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    bytes: Vec<u8>,
) -> tokio::task::JoinHandle<tokio::net::tcp::OwnedWriteHalf> {
    tokio::spawn(async move {
        wr.write_all(&bytes).await.unwrap();
        wr
    })
}

#[tokio::test]
async fn many_tiny_pushes_hold_bounded_bookkeeping() {
    let (mut s, mut raw) = raw_client().await;
    skip_preface(&mut raw).await;
    let n = 20_000u64;
    let mut records = Vec::new();
    for region in 1..=n {
        records.extend(push_record(region, 1, b"x"));
    }
    let (_rd, wr) = raw.into_split();
    let w = write_behind(wr, records);
    poll_raw_until(&mut s, |s| {
        let p = s.push_stats();
        p.held + p.dropped == n
    })
    .await;
    // Each held push is charged its bookkeeping as well as its byte.
    let most = tcp::wire::MAX_HELD / (1 + tcp::wire::HELD_ENTRY_COST);
    assert_eq!(s.pushes_held(), most);
    assert_eq!(s.push_stats().held, most as u64);
    w.await.unwrap();
}

#[tokio::test]
async fn held_pushes_whose_reads_never_come_are_let_go() {
    use tokio::io::AsyncReadExt;
    let (mut s, mut raw) = raw_client().await;
    skip_preface(&mut raw).await;
    let big = tcp::wire::MAX_PUSH;
    let (mut rd, wr) = raw.into_split();
    // Regions 1 and 2 come before any read: held, which fills the hold.
    let mut first = push_record(1, big as u32, &pattern(big, 1));
    first.extend(push_record(2, big as u32, &pattern(big, 2)));
    let w = write_behind(wr, first);
    poll_raw_until(&mut s, |s| s.pushes_held() == 2).await;
    let mut wr = w.await.unwrap();
    // The reader posts a read of region 4 next: the messages of regions 1 and 2 were
    // never read (refused, say), and their reads will not come now.
    let mut four = vec![0u8; 100];
    // SAFETY: `four` outlives the read, which completes below.
    unsafe { s.post_read(1, &descriptor(4 | 1 << 63, 100), 0, four.as_mut_ptr(), 100) }.unwrap();
    assert_eq!(
        s.pushes_held(),
        0,
        "held pushes below a region read are let go"
    );
    // A push below a region already read is not held either.
    wr.write_all(&push_record(3, 100, &pattern(100, 3)))
        .await
        .unwrap();
    wr.write_all(&push_record(4, 100, &pattern(100, 4)))
        .await
        .unwrap();
    let ev = own_event(&mut s).await.unwrap();
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
    assert_eq!(four, pattern(100, 4));
    // The hold has room again: region 5, ahead of its reads, is held, not dropped.
    let w = write_behind(wr, push_record(5, big as u32, &pattern(big, 5)));
    poll_raw_until(&mut s, |s| s.pushes_held() == 1).await;
    let wr = w.await.unwrap();
    assert_eq!(
        s.push_stats(),
        PushStats {
            direct: 1,
            held: 3,
            dropped: 1,
            ..Default::default()
        }
    );
    // A late read of a region let go asks the owner.
    let mut one = vec![0u8; 10];
    // SAFETY: `one` outlives the read, which the link fails when the peer goes.
    unsafe {
        s.post_read(
            2,
            &descriptor(1 | 1 << 63, big as u64),
            0,
            one.as_mut_ptr(),
            10,
        )
    }
    .unwrap();
    let mut req = [0u8; 5 + 28];
    rd.read_exact(&mut req).await.unwrap();
    assert_eq!(req[0], 1, "a read request");
    assert_eq!(&req[13..21], &1u64.to_le_bytes(), "for region 1");
    drop((rd, wr));
    let (failed, _) = fail_out(&mut s).await;
    assert_eq!(failed, [2]);
}
