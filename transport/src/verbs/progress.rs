//! Getting completions out of the completion queue. (Device events are the domain's:
//! `domain.rs`.)
//!
//! Two modes, so both can be measured:
//! - default: poll the CQ, spin for a short budget when it is empty, then arm the completion
//!   channel (`ibv_req_notify_cq`), poll once more (a completion that landed between the last
//!   poll and arming raises no event), and sleep on the channel fd in a tokio `AsyncFd`;
//! - `IBEX_VERBS_BUSY_POLL=1`: a dedicated thread spins on the CQ and hands completions over
//!   (AR-gRPC's mode: lowest latency, one core burnt per link).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::task::AtomicWaker;
use rdma_mummy_sys as sys;
use sideway::ibverbs::completion::{
    BasicCompletionQueue, CompletionChannel, CompletionQueue, PollCompletionQueueError,
};
use tokio::io::unix::AsyncFd;

use crate::error::{Error, Result};

/// One work completion, copied out of the CQ.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wc {
    pub wr_id: u64,
    pub status: u32,
    pub byte_len: u32,
    pub imm: u32,
}

/// An fd that rdma-core owns, together with the handle that keeps it open.
pub(crate) struct Fd(RawFd, #[allow(dead_code)] Arc<dyn Send + Sync>);

impl Fd {
    fn register(self, what: &str) -> Result<AsyncFd<Fd>> {
        // SAFETY: the fd stays open and the same while `self.1` (its owner) lives, and the
        // AsyncFd owns `self`.
        unsafe { AsyncFd::register_with_interest(self, tokio::io::Interest::READABLE) }.map_err(
            |e| {
                Error::io(
                    format!("registering the {what} with tokio (is a runtime running?)"),
                    e.into_parts().1,
                )
            },
        )
    }
}

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

fn poll_cq(cq: &BasicCompletionQueue, out: &mut Vec<Wc>) -> io::Result<usize> {
    match cq.start_poll() {
        Ok(poller) => {
            let before = out.len();
            for wc in poller {
                out.push(Wc {
                    wr_id: wc.wr_id(),
                    status: wc.status(),
                    byte_len: wc.byte_len(),
                    imm: wc.imm_data(),
                });
            }
            Ok(out.len() - before)
        }
        Err(PollCompletionQueueError::CompletionQueueEmpty) => Ok(0),
        Err(PollCompletionQueueError::Ibverbs(e)) => Err(e),
        #[allow(unreachable_patterns)]
        Err(e) => Err(io::Error::other(e.to_string())),
    }
}

pub(crate) struct BusyShared {
    queue: Mutex<Vec<Wc>>,
    waker: AtomicWaker,
    stop: AtomicBool,
    failed: Mutex<Option<io::Error>>,
}

/// Where completions come from. See the module docs.
pub(crate) enum Progress {
    Channel {
        // Deregistered from the reactor before the channel (held by `cq`) is destroyed.
        fd: AsyncFd<Fd>,
        cq: Arc<BasicCompletionQueue>,
        channel: Arc<CompletionChannel>,
        armed: bool,
        spin: Duration,
    },
    Busy {
        shared: Arc<BusyShared>,
        thread: Option<std::thread::JoinHandle<()>>,
        spin: Duration,
    },
}

impl Progress {
    /// Event-driven progress over `channel`, which `cq` was created with.
    pub fn channel(
        cq: Arc<BasicCompletionQueue>,
        channel: Arc<CompletionChannel>,
        spin: Duration,
    ) -> Result<Progress> {
        channel
            .set_nonblocking(true)
            .map_err(|e| Error::io("making the completion channel non-blocking", e))?;
        let fd = Fd(channel.as_raw_fd(), channel.clone()).register("completion channel")?;
        Ok(Progress::Channel {
            fd,
            cq,
            channel,
            armed: false,
            spin,
        })
    }

    /// A thread that spins on `cq` until this is dropped.
    pub fn busy(cq: Arc<BasicCompletionQueue>, spin: Duration) -> Result<Progress> {
        let shared = Arc::new(BusyShared {
            queue: Mutex::new(Vec::new()),
            waker: AtomicWaker::new(),
            stop: AtomicBool::new(false),
            failed: Mutex::new(None),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ibex-verbs-poll".into())
            .spawn(move || {
                let mut local = Vec::with_capacity(64);
                while !sh.stop.load(Ordering::Acquire) {
                    match poll_cq(&cq, &mut local) {
                        Ok(0) => std::thread::yield_now(),
                        Ok(_) => {
                            if let Ok(mut q) = sh.queue.lock() {
                                q.append(&mut local);
                            }
                            sh.waker.wake();
                        }
                        Err(e) => {
                            if let Ok(mut f) = sh.failed.lock() {
                                *f = Some(e);
                            }
                            sh.waker.wake();
                            return;
                        }
                    }
                }
            })
            .map_err(|e| Error::io("starting the verbs busy-poll thread", e))?;
        Ok(Progress::Busy {
            shared,
            thread: Some(thread),
            spin,
        })
    }

    /// Appends available completions to `out` without waiting. Returns how many.
    pub fn poll_now(&mut self, out: &mut Vec<Wc>) -> Result<usize> {
        match self {
            Progress::Channel { cq, .. } => {
                poll_cq(cq, out).map_err(|e| Error::io("polling the completion queue", e))
            }
            Progress::Busy { shared, .. } => {
                if let Some(e) = shared.failed.lock().ok().and_then(|mut f| f.take()) {
                    return Err(Error::io(
                        "polling the completion queue (busy-poll thread)",
                        e,
                    ));
                }
                let mut q = shared
                    .queue
                    .lock()
                    .map_err(|_| Error::Config("verbs completion queue lock poisoned".into()))?;
                let n = q.len();
                out.append(&mut q);
                Ok(n)
            }
        }
    }

    /// `Ready` once at least one completion was appended to `out`; `Pending` with `cx`
    /// registered for the next one otherwise.
    pub fn poll_fetch(&mut self, cx: &mut Context<'_>, out: &mut Vec<Wc>) -> Poll<Result<()>> {
        if self.poll_now(out)? > 0 {
            return Poll::Ready(Ok(()));
        }
        let (Progress::Channel { spin, .. } | Progress::Busy { spin, .. }) = self;
        let (start, spin) = (Instant::now(), *spin);
        while start.elapsed() < spin {
            if self.poll_now(out)? > 0 {
                return Poll::Ready(Ok(()));
            }
            std::hint::spin_loop();
        }
        match self {
            Progress::Busy { shared, .. } => {
                shared.waker.register(cx.waker());
                // Re-check: the thread may have pushed between our poll and the registration.
                if self.poll_now(out)? > 0 {
                    Poll::Ready(Ok(()))
                } else {
                    Poll::Pending
                }
            }
            Progress::Channel { .. } => self.poll_channel(cx, out),
        }
    }

    fn poll_channel(&mut self, cx: &mut Context<'_>, out: &mut Vec<Wc>) -> Poll<Result<()>> {
        loop {
            let Progress::Channel {
                fd,
                cq,
                channel,
                armed,
                ..
            } = self
            else {
                return Poll::Pending;
            };
            if !*armed {
                // SAFETY: `cq` is a live CQ created with a completion channel; the provider's
                // req_notify_cq only touches that CQ.
                let rc = unsafe { sys::ibv_req_notify_cq(cq.cq().as_ptr(), 0) };
                if rc != 0 {
                    return Poll::Ready(Err(Error::io(
                        "arming the completion queue",
                        io::Error::from_raw_os_error(rc),
                    )));
                }
                *armed = true;
                // A completion that arrived before arming raises no event: look once more.
                if poll_cq(cq, out).map_err(|e| Error::io("polling the completion queue", e))? > 0 {
                    return Poll::Ready(Ok(()));
                }
            }
            match fd.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => {
                    return Poll::Ready(Err(Error::io("waiting on the completion channel", e)));
                }
                Poll::Ready(Ok(mut guard)) => {
                    let mut n = 0u32;
                    let mut ev_cq: *mut sys::ibv_cq = std::ptr::null_mut();
                    loop {
                        let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
                        // SAFETY: the channel is live and non-blocking; the out-pointers are ours.
                        let rc = unsafe {
                            sys::ibv_get_cq_event(
                                channel.comp_channel().as_ptr(),
                                &mut ev_cq,
                                &mut ctx,
                            )
                        };
                        if rc != 0 {
                            break;
                        }
                        n += 1;
                    }
                    if n > 0 {
                        // SAFETY: every event came from our only CQ; acking them now keeps
                        // ibv_destroy_cq from blocking at drop.
                        unsafe { sys::ibv_ack_cq_events(cq.cq().as_ptr(), n) };
                        *armed = false;
                    }
                    guard.clear_ready();
                }
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Progress::Busy { shared, thread, .. } = self {
            shared.stop.store(true, Ordering::Release);
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}
