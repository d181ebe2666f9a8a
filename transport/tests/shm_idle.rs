//! An idle shm connection must not burn CPU: after a short spin both sides sleep on their
//! eventfds. Alone in its own test binary so the process's CPU time is this test's.

mod shm_util;

use std::future::poll_fn;
use std::time::{Duration, Instant};

use ibex_transport::link::{Link, LinkEvent};
use shm_util::*;
use tokio::sync::oneshot;

fn cpu_time() -> Duration {
    // SAFETY: `ru` is plain data filled by the kernel.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) }, 0);
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connected_pair_uses_no_cpu_and_still_wakes() {
    let cfg = small_config();
    let (mut a, mut b) = pair("idle", &cfg, &cfg).await;
    // Both ends wait for events, as a driver does on a quiet connection.
    let waiter = tokio::spawn(async move {
        let ev = poll_fn(|cx| a.poll_event(cx)).await;
        (a, ev)
    });
    let (stop, stopped) = oneshot::channel::<()>();
    let idle_b = tokio::spawn(async move {
        let mut stopped = stopped;
        tokio::select! {
            _ = &mut stopped => {}
            ev = poll_fn(|cx| b.poll_event(cx)) => panic!("idle side got {ev:?}"),
        }
        b
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (cpu0, wall0) = (cpu_time(), Instant::now());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (cpu, wall) = (cpu_time() - cpu0, wall0.elapsed());
    eprintln!("idle pair: {cpu:?} of CPU in {wall:?}");
    assert!(
        cpu.as_secs_f64() < 0.05 * wall.as_secs_f64(),
        "idle pair used {cpu:?} of CPU in {wall:?} (limit 5% of a core)"
    );
    // Asleep, not dead: a frame wakes the waiting side.
    stop.send(()).unwrap();
    let mut b = idle_b.await.unwrap();
    send(&mut b, b"wake").await.unwrap();
    let (_a, ev) = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("woken")
        .unwrap();
    match ev.unwrap() {
        LinkEvent::Frame(f) => assert_eq!(&f[..], b"wake"),
        other => panic!("{other:?}"),
    }
}
