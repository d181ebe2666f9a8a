//! Integration tests of the shm provider: setup, frames, rendezvous reads (CMA, bounce,
//! pool mapping), bad descriptors, auth, socket paths and close. Child processes (this
//! binary re-executed on an `#[ignore]`d test) cover the two-process case and the forced
//! bounce path, whose switch the child takes from the environment (`Config::from_env`).

mod shm_util;

use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use ibex_transport::link::{Link, LinkEvent};
use ibex_transport::shm::{self, ShmLink};
use ibex_transport::{Config, Error};
use shm_util::*;
use tokio::sync::oneshot;

/// Drives `link`'s `poll_event` in a task (so it serves bounce reads) until told to stop;
/// gives the link back with the frames that arrived meanwhile.
fn drive(
    mut link: ShmLink,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<(ShmLink, Vec<Bytes>)>,
) {
    let (tx, mut rx) = oneshot::channel::<()>();
    let h = tokio::spawn(async move {
        let mut frames = Vec::new();
        loop {
            let stop = tokio::select! {
                _ = &mut rx => true,
                ev = poll_fn(|cx| link.poll_event(cx)) => match ev {
                    Ok(LinkEvent::Frame(f)) => {
                        frames.push(f);
                        false
                    }
                    Ok(LinkEvent::ReadDone { id, .. }) => panic!("owner got a completion {id} it never asked for"),
                    Err(e) => panic!("owner link failed: {e}"),
                },
            };
            if stop {
                return (link, frames);
            }
        }
    });
    (tx, h)
}

fn frame_bytes(i: usize, max: usize) -> Vec<u8> {
    let len = (i * 37) % (max + 1);
    (0..len).map(|j| (i.wrapping_mul(31) + j) as u8).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_arrive_in_order_and_intact_both_ways() {
    let cfg = small_config();
    let (mut a, mut b) = pair("frames", &cfg, &cfg).await;
    let max = a.info().max_frame;
    assert_eq!(max, cfg.slot_size);
    assert_eq!(a.info().provider, "shm");
    // Every size from 0 to the maximum, then more, through a ring that fills many times.
    let n = 6000;
    let sender = tokio::spawn(async move {
        for i in 0..n {
            let f = if i <= max {
                vec![(i % 251) as u8; i]
            } else {
                frame_bytes(i, max)
            };
            send(&mut a, &f).await.expect("send");
        }
        a
    });
    for i in 0..n {
        let want = if i <= max {
            vec![(i % 251) as u8; i]
        } else {
            frame_bytes(i, max)
        };
        let got = frame(&mut b).await;
        assert_eq!(got.len(), want.len(), "frame {i}");
        assert!(got[..] == want[..], "frame {i} corrupted");
    }
    let mut a = sender.await.unwrap();
    // And back.
    let back = tokio::spawn(async move {
        for i in 0..500 {
            send(&mut b, &frame_bytes(i, max)).await.expect("send back");
        }
        b
    });
    for i in 0..500 {
        assert_eq!(frame(&mut a).await[..], frame_bytes(i, max)[..]);
    }
    back.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frame_is_refused() {
    let cfg = small_config();
    let (mut a, _b) = pair("oversized", &cfg, &cfg).await;
    let e = send(&mut a, &vec![0u8; cfg.slot_size + 1])
        .await
        .unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
}

struct CountingWaker(AtomicUsize);
impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_ring_is_pending_then_progresses_when_the_peer_reads() {
    let cfg = Config {
        slot_size: 1024,
        credits: 1,
        ..small_config()
    };
    let (mut a, mut b) = pair("full", &cfg, &cfg).await;
    let w = Arc::new(CountingWaker(AtomicUsize::new(0)));
    let waker = Waker::from(w.clone());
    let mut cx = Context::from_waker(&waker);
    let f = [7u8; 1024];
    let mut sent = 0;
    loop {
        match a.poll_send(&mut cx, &f) {
            Poll::Ready(Ok(())) => sent += 1,
            Poll::Ready(Err(e)) => panic!("{e}"),
            Poll::Pending => break,
        }
        assert!(sent < 10_000, "the ring never filled");
    }
    assert!(sent >= 4, "only {sent} frames fit");
    assert_eq!(w.0.load(Ordering::SeqCst), 0);
    // One read frees space; the producer was waiting, so it is woken through its eventfd.
    assert_eq!(frame(&mut b).await[..], f[..]);
    for _ in 0..5000 {
        if w.0.load(Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        w.0.load(Ordering::SeqCst) > 0,
        "the waiting producer was never woken"
    );
    assert!(matches!(a.poll_send(&mut cx, &f), Poll::Ready(Ok(()))));
    for _ in 0..sent {
        assert_eq!(frame(&mut b).await[..], f[..]);
    }
}

/// True if this process may read itself with process_vm_readv (the sandbox allows CMA).
fn cma_allowed() -> bool {
    let word = 0x5eed_u64;
    let mut out = 0u64;
    let local = libc::iovec {
        iov_base: (&mut out as *mut u64).cast(),
        iov_len: 8,
    };
    let remote = libc::iovec {
        iov_base: (&word as *const u64 as *mut u64).cast(),
        iov_len: 8,
    };
    // SAFETY: both iovecs describe live 8-byte locals.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    n == 8 && out == word
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_read_via_cma_in_fragments() {
    let cfg = small_config();
    let (mut a, mut b) = pair("cma", &cfg, &cfg).await;
    if cma_allowed() && !cfg.shm_force_bounce {
        assert_eq!(b.info().rendezvous_path, "cma");
        assert!(b.info().one_sided);
    }
    let len = 64 << 20;
    let data = pattern(len, 1);
    let exp = a.expose(data.clone()).unwrap();
    assert!(!exp.zero_copy);
    assert_eq!(
        b.map_remote(&exp.descriptor, len as u64).unwrap(),
        None,
        "heap memory is not mappable"
    );
    let got = read_all(&mut b, &exp.descriptor, 0, len, 512 << 10, 4)
        .await
        .unwrap();
    assert!(got.as_slice() == &data[..], "64 MiB read corrupted");
    // An unaligned piece in the middle.
    let got = read_all(&mut b, &exp.descriptor, 1_000_003, 777_777, 100_000, 3)
        .await
        .unwrap();
    assert!(got.as_slice() == &data[1_000_003..1_000_003 + 777_777]);
    assert_eq!(a.withdraw(exp.id).map(|b| b.len()), Some(len));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_buffers_are_mapped_by_the_peer_without_a_copy() {
    let cfg = small_config();
    let (mut a, mut b) = pair("pool", &cfg, &cfg).await;
    let pool = a.pool().expect("shm links have a pool");
    assert_eq!(pool.size(), cfg.pool_size);
    let mut buf = pool.alloc(100_000).unwrap();
    buf.copy_from_slice(&pattern(100_000, 9));
    let sent = buf.freeze();
    let exp = a.expose(sent.clone()).unwrap();
    assert!(exp.zero_copy);
    let view = b
        .map_remote(&exp.descriptor, 100_000)
        .unwrap()
        .expect("pool memory maps");
    assert_eq!(view[..], sent[..]);
    // The view is the peer's read-only shared mapping of the same memfd, not a copy.
    let line = mapping_of(view.as_ptr() as usize).expect("view address is mapped");
    assert!(
        line.contains("memfd:ibex-shm-pool") && line.contains(" r--s "),
        "{line}"
    );
    let own = mapping_of(sent.as_ptr() as usize).unwrap();
    assert!(
        own.contains("memfd:ibex-shm-pool") && own.contains(" rw-s "),
        "{own}"
    );
    assert_ne!(view.as_ptr(), sent.as_ptr());
    // A write through the owner's mapping shows through the view: same pages.
    let mut probe = pool.alloc(64).unwrap();
    probe[0] = 1;
    let probe = probe.freeze();
    let pexp = a.expose(probe.clone()).unwrap();
    let pview = b.map_remote(&pexp.descriptor, 64).unwrap().unwrap();
    assert_eq!(pview[0], 1);

    // Wrong length, out of range, garbage.
    assert!(matches!(
        b.map_remote(&exp.descriptor, 99_999),
        Err(Error::Protocol(_))
    ));
    let mut forged = exp.descriptor.to_vec();
    forged[8..16].copy_from_slice(&(cfg.pool_size as u64 - 10).to_le_bytes());
    assert!(matches!(
        b.map_remote(&forged, 100_000),
        Err(Error::Protocol(_))
    ));
    assert!(matches!(
        b.map_remote(b"garbage", 7),
        Err(Error::Protocol(_))
    ));
    // post_read on a pool descriptor copies from the mapping.
    let got = read_all(&mut b, &exp.descriptor, 50, 1000, 300, 2)
        .await
        .unwrap();
    assert_eq!(got.as_slice(), &sent[50..1050]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_descriptors_and_ranges_are_errors() {
    let cfg = small_config();
    let (mut a, mut b) = pair("baddesc", &cfg, &cfg).await;
    let exp = a.expose(pattern(10_000, 2)).unwrap();
    let mut dst = vec![0u8; 20_000];
    // SAFETY: dst outlives the link calls and no read is accepted (each is refused).
    unsafe {
        assert!(matches!(
            b.post_read(1, &exp.descriptor, 5_000, dst.as_mut_ptr(), 5_001),
            Err(Error::Protocol(_))
        ));
        assert!(matches!(
            b.post_read(2, &exp.descriptor, u64::MAX, dst.as_mut_ptr(), 2),
            Err(Error::Protocol(_))
        ));
        assert!(matches!(
            b.post_read(3, b"nonsense", 0, dst.as_mut_ptr(), 1),
            Err(Error::Protocol(_))
        ));
        // A REGION descriptor naming another process must not become a read of it.
        let mut forged = exp.descriptor.to_vec();
        forged[4..8].copy_from_slice(&1u32.to_le_bytes());
        let e = b
            .post_read(4, &forged, 0, dst.as_mut_ptr(), 10)
            .unwrap_err();
        assert!(e.to_string().contains("process 1"), "{e}");
    }
    assert!(matches!(b.map_remote(&[], 0), Err(Error::Protocol(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_token_mismatch_is_refused_on_both_sides() {
    for (ta, tb) in [
        (Some("alpha"), Some("beta")),
        (Some("alpha"), None),
        (None, Some("beta")),
    ] {
        let ca = Config {
            auth_token: ta.map(String::from),
            ..small_config()
        };
        let cb = Config {
            auth_token: tb.map(String::from),
            ..small_config()
        };
        let path = sock_path("auth");
        let l = shm::listen(&path, &ca).await.unwrap();
        let (x, y) = tokio::join!(l.accept(), shm::connect(&path, &cb));
        for r in [x, y] {
            let e = r.unwrap_err();
            assert!(matches!(e, Error::Handshake(_)), "{e}");
            assert!(e.to_string().contains("IBEX_AUTH_TOKEN"), "{e}");
        }
    }
    let c = Config {
        auth_token: Some("same".into()),
        ..small_config()
    };
    let (mut a, mut b) = pair("auth-ok", &c, &c).await;
    send(&mut a, b"hi").await.unwrap();
    assert_eq!(&frame(&mut b).await[..], b"hi");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_socket_is_replaced_and_live_one_refused() {
    let cfg = small_config();
    let path = sock_path("stale");
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(
        path.exists(),
        "a dropped std listener leaves its file behind"
    );
    let l = shm::listen(&path, &cfg)
        .await
        .expect("stale socket file is replaced");
    let e = shm::listen(&path, &cfg).await.unwrap_err();
    assert!(
        matches!(e, Error::Address { .. }) && e.to_string().contains("listening"),
        "{e}"
    );
    let (x, y) = tokio::join!(l.accept(), shm::connect(&path, &cfg));
    let (mut x, mut y) = (x.unwrap(), y.unwrap());
    send(&mut y, b"ok").await.unwrap();
    assert_eq!(&frame(&mut x).await[..], b"ok");
    drop(l);
    assert!(!path.exists(), "the listener removes its socket file");
    let e = shm::connect(&path, &cfg).await.unwrap_err();
    assert!(e.to_string().contains("listening"), "{e}");
    // A regular file is never deleted.
    let file = sock_path("regular");
    std::fs::write(&file, b"x").unwrap();
    assert!(shm::listen(&file, &cfg).await.is_err());
    assert!(file.exists());
    std::fs::remove_file(&file).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_ibex_peer_is_refused_with_a_clear_error() {
    let cfg = small_config();
    let path = sock_path("garbage");
    let l = shm::listen(&path, &cfg).await.unwrap();
    let junk = async {
        use tokio::io::AsyncWriteExt;
        let mut s = tokio::net::UnixStream::connect(&path).await.unwrap();
        s.write_all(&[0u8; 200]).await.unwrap();
        s
    };
    let (r, _s) = tokio::join!(l.accept(), junk);
    let e = r.unwrap_err();
    assert!(e.to_string().contains("magic"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_delivers_what_was_sent_then_peer_closed() {
    let cfg = small_config();
    let (mut a, mut b) = pair("close", &cfg, &cfg).await;
    for i in 0..3u8 {
        send(&mut a, &[i; 10]).await.unwrap();
    }
    a.close();
    assert!(matches!(
        send(&mut a, b"late").await,
        Err(Error::LocallyClosed)
    ));
    for i in 0..3u8 {
        assert_eq!(frame(&mut b).await[..], [i; 10]);
    }
    let e = event(&mut b).await.unwrap_err();
    assert!(matches!(e, Error::PeerClosed(_)), "{e}");
    assert!(
        matches!(event(&mut b).await, Err(Error::PeerClosed(_))),
        "the error sticks"
    );
    assert!(send(&mut b, b"x").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_peer_is_peer_gone() {
    let cfg = small_config();
    let (a, mut b) = pair("drop", &cfg, &cfg).await;
    drop(a);
    let e = tokio::time::timeout(Duration::from_secs(10), event(&mut b))
        .await
        .expect("no hang")
        .unwrap_err();
    assert!(matches!(e, Error::PeerGone(_)), "{e}");
    // A sender facing a gone peer fills the ring, then fails instead of waiting forever.
    let (mut c, d) = pair("drop-send", &cfg, &cfg).await;
    drop(d);
    let fill = async {
        loop {
            if let Err(e) = send(&mut c, &[1u8; 4096]).await {
                return e;
            }
        }
    };
    let e = tokio::time::timeout(Duration::from_secs(10), fill)
        .await
        .expect("no hang");
    assert!(matches!(e, Error::PeerGone(_)), "{e}");
}

#[test]
fn bounce_reads_when_cma_is_forced_off() {
    run_child("bounce_child", &[("IBEX_SHM_FORCE_BOUNCE", "1")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: run by bounce_reads_when_cma_is_forced_off with IBEX_SHM_FORCE_BOUNCE=1"]
async fn bounce_child() {
    let cfg = small_config();
    assert!(
        cfg.shm_force_bounce,
        "IBEX_SHM_FORCE_BOUNCE=1 reaches the Config"
    );
    let (mut a, mut b) = pair("bounce", &cfg, &cfg).await;
    assert_eq!(b.info().rendezvous_path, "bounce");
    assert!(!b.info().one_sided);
    let len = 64 << 20;
    let data = pattern(len, 3);
    let exp = a.expose(data.clone()).unwrap();
    let (stop, owner) = drive(a);
    let got = read_all(&mut b, &exp.descriptor, 0, len, 512 << 10, 8)
        .await
        .unwrap();
    assert!(got.as_slice() == &data[..], "64 MiB bounce read corrupted");
    // Unaligned, spanning several slots, one read at a time.
    let got = read_all(&mut b, &exp.descriptor, 123_457, 1_000_001, 1_000_001, 1)
        .await
        .unwrap();
    assert!(got.as_slice() == &data[123_457..123_457 + 1_000_001]);
    // Frames do not starve reads: with frames queued behind a request, the owner serves
    // it while handing out those frames (its driver may never see an empty ring).
    stop.send(()).unwrap();
    let (mut a, _) = owner.await.unwrap();
    let mut small = vec![0u8; 4096];
    // SAFETY: `small` outlives the read, which completes below before it is dropped.
    unsafe { b.post_read(7, &exp.descriptor, 4096, small.as_mut_ptr(), 4096) }.unwrap();
    // The request record is in the ring already: nothing is left to flush.
    poll_fn(|cx| b.poll_flush(cx)).await.unwrap();
    send(&mut b, b"f1").await.unwrap();
    send(&mut b, b"f2").await.unwrap();
    assert_eq!(&frame(&mut a).await[..], b"f1");
    assert_eq!(&frame(&mut a).await[..], b"f2");
    match tokio::time::timeout(Duration::from_secs(10), event(&mut b))
        .await
        .expect("read served")
    {
        Ok(LinkEvent::ReadDone {
            id: 7,
            result: Ok(()),
        }) => assert_eq!(small[..], data[4096..8192]),
        other => panic!("{other:?}"),
    }
    let (stop, owner) = drive(a);
    // Out of range is refused locally.
    let mut dst = vec![0u8; 16];
    // SAFETY: refused before anything is written.
    let r = unsafe { b.post_read(99, &exp.descriptor, len as u64 - 8, dst.as_mut_ptr(), 16) };
    assert!(matches!(r, Err(Error::Protocol(_))));
    // A withdrawn region is refused by the owner, as a failed completion.
    stop.send(()).unwrap();
    let (mut a, _) = owner.await.unwrap();
    assert!(a.withdraw(exp.id).is_some());
    let (stop, owner) = drive(a);
    let e = read_all(&mut b, &exp.descriptor, 0, 4096, 4096, 1)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not exposed"), "{e}");
    // Frames still flow while the owner serves reads.
    send(&mut b, b"after").await.unwrap();
    stop.send(()).unwrap();
    let (mut a, mut seen) = owner.await.unwrap();
    if seen.is_empty() {
        seen.push(frame(&mut a).await);
    }
    assert_eq!(seen, vec![Bytes::from_static(b"after")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_exchange_frames_and_a_region() {
    let cfg = small_config();
    let path = sock_path("twoproc");
    let l = shm::listen(&path, &cfg).await.unwrap();
    let kid = child(
        "two_process_child",
        &[("IBEX_SHM_TEST_PATH", path.to_str().unwrap())],
    )
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let mut link = l.accept().await.unwrap();
    assert_eq!(link.peer_pid() as u32, kid.id());
    let max = link.info().max_frame;
    for i in 0..2000 {
        assert_eq!(
            frame(&mut link).await[..],
            frame_bytes(i, max)[..],
            "frame {i}"
        );
    }
    let desc = frame(&mut link).await;
    let len = 8 << 20;
    let got = read_all(&mut link, &desc, 0, len, 512 << 10, 4)
        .await
        .unwrap();
    assert!(
        got.as_slice() == &pattern(len, 5)[..],
        "cross-process read corrupted"
    );
    send(&mut link, b"done").await.unwrap();
    let e = event(&mut link).await.unwrap_err();
    assert!(matches!(e, Error::PeerClosed(_)), "{e}");
    let out = kid.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "child failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: run by two_processes_exchange_frames_and_a_region"]
async fn two_process_child() {
    let path = std::env::var("IBEX_SHM_TEST_PATH").expect("run by the parent test");
    let mut link = shm::connect(path.as_ref(), &small_config()).await.unwrap();
    let max = link.info().max_frame;
    for i in 0..2000 {
        send(&mut link, &frame_bytes(i, max)).await.unwrap();
    }
    let exp = link.expose(pattern(8 << 20, 5)).unwrap();
    send(&mut link, &exp.descriptor).await.unwrap();
    // poll_event serves bounce reads while it waits for the parent's "done".
    match event(&mut link).await.unwrap() {
        LinkEvent::Frame(f) => assert_eq!(&f[..], b"done"),
        other => panic!("unexpected {other:?}"),
    }
    link.close();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_copies_wait_for_the_driver_once_it_asked_for_them() {
    let cfg = small_config();
    let (a, mut b) = pair("work", &cfg, &cfg).await;
    // From the shared pool, so the copy is a plain memcpy whether or not CMA is allowed.
    let mut a = a;
    let mut buf = a.pool().unwrap().alloc(1 << 20).unwrap();
    buf.copy_from_slice(&pattern(1 << 20, 5));
    let data = buf.freeze();
    let exp = a.expose(data.clone()).unwrap();
    b.enable_work();
    let mut big = vec![0u8; 256 << 10];
    let mut small = vec![0u8; 1024];
    // SAFETY: both buffers outlive the reads, which complete below.
    unsafe {
        b.post_read(1, &exp.descriptor, 0, big.as_mut_ptr(), big.len())
            .unwrap();
        b.post_read(2, &exp.descriptor, 4096, small.as_mut_ptr(), small.len())
            .unwrap();
    }
    // The small copy was done at once; the large one waits for whoever runs the work.
    match event(&mut b).await {
        Ok(LinkEvent::ReadDone {
            id: 2,
            result: Ok(()),
        }) => assert_eq!(small[..], data[4096..4096 + 1024]),
        other => panic!("{other:?}"),
    }
    let work = b.take_work();
    assert_eq!(work.len(), 1, "the 256 KiB copy is handed over");
    assert!(b.take_work().is_empty(), "once");
    for (id, result) in work.into_iter().map(|w| w.run()) {
        b.work_done(id, result);
    }
    match event(&mut b).await {
        Ok(LinkEvent::ReadDone {
            id: 1,
            result: Ok(()),
        }) => assert!(big[..] == data[..256 << 10]),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_says_when_it_had_to_wake_a_sleeping_peer() {
    let cfg = small_config();
    let (mut a, mut b) = pair("woke", &cfg, &cfg).await;
    // The peer has not waited yet, so nothing needs waking.
    send(&mut a, b"one").await.expect("send");
    assert!(!a.take_woke_peer(), "the peer was awake");
    assert_eq!(&frame(&mut b).await[..], b"one");
    // The peer finds nothing more and goes to sleep on its eventfd.
    let mut cx = Context::from_waker(Waker::noop());
    assert!(b.poll_event(&mut cx).is_pending());
    send(&mut a, b"two").await.expect("send");
    assert!(a.take_woke_peer(), "the peer slept, so the send woke it");
    assert!(!a.take_woke_peer(), "asking clears it");
    send(&mut a, b"three").await.expect("send");
    assert!(!a.take_woke_peer(), "already woken: no second signal");
    assert_eq!(&frame(&mut b).await[..], b"two");
    assert_eq!(&frame(&mut b).await[..], b"three");
}
