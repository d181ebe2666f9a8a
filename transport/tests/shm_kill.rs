//! A peer SIGKILLed in the middle of a rendezvous read: the reader gets `PeerGone` (no
//! hang), and once it drops the link no descriptor or memfd mapping is left behind.
//!
//! Each scenario runs in a child process of its own (this binary, re-executed on the
//! `#[ignore]`d `kill_scenario`), so descriptor and mapping counts are not disturbed by
//! other tests, and the bounce variant can set `IBEX_SHM_FORCE_BOUNCE` for itself. That
//! reader in turn starts the exposing process (`kill_exposer`) and kills it.

mod shm_util;

use std::time::Duration;

use ibex_transport::Error;
use ibex_transport::link::{Link, LinkEvent};
use ibex_transport::shm;
use shm_util::*;

const REGION: usize = 64 << 20;
const FRAG: usize = 512 << 10;

#[test]
fn killed_peer_during_cma_read_is_peer_gone_and_leaks_nothing() {
    run_child("kill_scenario", &[]);
}

#[test]
fn killed_peer_during_bounce_read_is_peer_gone_and_leaks_nothing() {
    run_child("kill_scenario", &[("IBEX_SHM_FORCE_BOUNCE", "1")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: run by the killed_peer_* tests in a process of its own"]
async fn kill_scenario() {
    let fds_before = fd_count();
    assert_eq!(memfd_maps(), 0);
    let cfg = small_config();
    let path = sock_path("kill");
    let listener = shm::listen(&path, &cfg).await.unwrap();
    let mut kid = child(
        "kill_exposer",
        &[("IBEX_SHM_TEST_PATH", path.to_str().unwrap())],
    )
    .spawn()
    .unwrap();
    let kid_pid = kid.id() as i32;
    let mut link = listener.accept().await.unwrap();
    let desc = frame(&mut link).await;
    let mut dst = link.alloc_recv(REGION).unwrap();
    let base = dst.as_mut_ptr();

    let reading = read_until_failure(&mut link, &desc, base, kid_pid);
    let e = tokio::time::timeout(Duration::from_secs(10), reading)
        .await
        .expect("the reader hung");
    eprintln!("reader saw: {e}");
    assert!(matches!(e, Error::PeerGone(_)), "{e}");
    // The link stays dead.
    let again = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match poll_fn_event(&mut link).await {
                Ok(LinkEvent::ReadDone { .. }) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("no hang after the failure");
    assert!(matches!(again, Err(Error::PeerGone(_))), "{again:?}");
    assert!(memfd_maps() > 0);
    drop(link);
    drop(dst);
    drop(listener);
    kid.wait().unwrap();
    assert_eq!(
        memfd_maps(),
        0,
        "memfd mappings left after dropping the link"
    );
    assert_eq!(
        fd_count(),
        fds_before,
        "descriptors left after dropping the link"
    );
}

/// Re-reads the region in fragments, 4 in flight, killing the exposer after the first
/// completion, until something fails.
async fn read_until_failure(
    link: &mut shm::ShmLink,
    desc: &[u8],
    base: *mut u8,
    kid_pid: i32,
) -> Error {
    let (mut next, mut outstanding, mut done) = (0usize, 0usize, 0usize);
    loop {
        while outstanding < 4 {
            // SAFETY: base+next..+FRAG lies in the caller's buffer, dropped after the link.
            if let Err(e) =
                unsafe { link.post_read(next as u64, desc, next as u64, base.add(next), FRAG) }
            {
                return e;
            }
            next = (next + FRAG) % REGION;
            outstanding += 1;
        }
        match poll_fn_event(link).await {
            Err(e) => return e,
            Ok(LinkEvent::ReadDone { result, .. }) => {
                outstanding -= 1;
                if let Err(e) = result {
                    return e;
                }
                done += 1;
                if done == 1 {
                    // SAFETY: plain syscall on our own child.
                    assert_eq!(unsafe { libc::kill(kid_pid, libc::SIGKILL) }, 0);
                }
            }
            Ok(LinkEvent::Frame(f)) => panic!("unexpected frame {f:?}"),
        }
    }
}

async fn poll_fn_event(link: &mut shm::ShmLink) -> Result<LinkEvent, Error> {
    std::future::poll_fn(|cx| link.poll_event(cx)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: the process kill_scenario exposes memory from and kills"]
async fn kill_exposer() {
    let path = std::env::var("IBEX_SHM_TEST_PATH").expect("run by kill_scenario");
    let mut link = shm::connect(path.as_ref(), &small_config()).await.unwrap();
    let exp = link.expose(pattern(REGION, 7)).unwrap();
    send(&mut link, &exp.descriptor).await.unwrap();
    // Serve reads until killed.
    loop {
        if event(&mut link).await.is_err() {
            return;
        }
    }
}
