//! How a connection lets go of its link on a graceful close: the link is told to close,
//! then flushed until it says everything went out, and only then dropped (a verbs link
//! still holds unacknowledged sends after `close`, and dropping its queue pair would
//! discard them); a link that never finishes flushing is dropped after the linger (5 s),
//! not waited on for ever. Driven over real tcp links, with the server's link wrapped in
//! [`Holding`], a link that holds its flush back after `close` the way verbs does.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use ibex_transport::link::{Exposure, Link, LinkEvent, LinkInfo, RecvBuf, Work};
use ibex_transport::pool::Pool;
use ibex_transport::tcp::{self, TcpLink};
use ibex_transport::{Config, Connection, Error};

/// A hang guard, not a performance assertion.
const GUARD: Duration = Duration::from_secs(30);

/// What the connection did with a [`Holding`] link, in order.
#[derive(Debug, Default)]
struct Log {
    closed: bool,
    /// `poll_flush` said `Ready` after `close`.
    flushed_after_close: bool,
    /// Dropped; and whether that came before the flush after `close` was ready.
    dropped: bool,
    dropped_unflushed: bool,
}

/// After `close`, `poll_flush` answers `Pending` `hold` times (waking at once each time)
/// before it asks the real link; `None`: for ever, with no wake-up, as a verbs link whose
/// peer never acknowledges.
struct Holding {
    inner: TcpLink,
    hold: Option<u32>,
    log: Arc<Mutex<Log>>,
}

impl Drop for Holding {
    fn drop(&mut self) {
        let mut log = self.log.lock().unwrap();
        log.dropped = true;
        log.dropped_unflushed = !log.flushed_after_close;
    }
}

impl Link for Holding {
    fn info(&self) -> LinkInfo {
        self.inner.info()
    }
    fn poll_send(&mut self, cx: &mut Context<'_>, frame: &[u8]) -> Poll<Result<(), Error>> {
        self.inner.poll_send(cx, frame)
    }
    fn poll_send_parts(
        &mut self,
        cx: &mut Context<'_>,
        head: &[u8],
        body: &[u8],
    ) -> Poll<Result<(), Error>> {
        self.inner.poll_send_parts(cx, head, body)
    }
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        if !self.log.lock().unwrap().closed {
            return self.inner.poll_flush(cx);
        }
        match &mut self.hold {
            None => return Poll::Pending,
            Some(0) => {}
            Some(n) => {
                *n -= 1;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
        let r = self.inner.poll_flush(cx);
        if r.is_ready() {
            self.log.lock().unwrap().flushed_after_close = true;
        }
        r
    }
    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Result<LinkEvent, Error>> {
        self.inner.poll_event(cx)
    }
    fn try_event(&mut self) -> Option<Result<LinkEvent, Error>> {
        self.inner.try_event()
    }
    fn busy_poll(&self) -> bool {
        self.inner.busy_poll()
    }
    fn take_woke_peer(&mut self) -> bool {
        self.inner.take_woke_peer()
    }
    fn expose(&mut self, buf: Bytes) -> Result<Exposure, Error> {
        self.inner.expose(buf)
    }
    fn withdraw(&mut self, id: u64) -> Option<Bytes> {
        self.inner.withdraw(id)
    }
    fn map_remote(&mut self, descriptor: &[u8], len: u64) -> Result<Option<Bytes>, Error> {
        self.inner.map_remote(descriptor, len)
    }
    fn alloc_recv(&mut self, len: usize) -> Result<RecvBuf, Error> {
        self.inner.alloc_recv(len)
    }
    unsafe fn post_read(
        &mut self,
        id: u64,
        descriptor: &[u8],
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), Error> {
        // SAFETY: the caller's guarantees for `dst` are passed on unchanged.
        unsafe { self.inner.post_read(id, descriptor, offset, dst, len) }
    }
    fn readable_dst(&self, ptr: *const u8, len: usize) -> bool {
        self.inner.readable_dst(ptr, len)
    }
    fn pool(&self) -> Option<Arc<Pool>> {
        self.inner.pool()
    }
    fn close(&mut self) {
        self.log.lock().unwrap().closed = true;
        self.inner.close();
    }
    fn enable_work(&mut self) {
        self.inner.enable_work()
    }
    fn take_work(&mut self) -> Vec<Work> {
        self.inner.take_work()
    }
    fn has_work(&self) -> bool {
        self.inner.has_work()
    }
    fn work_done(&mut self, id: u64, result: Result<(), Error>) {
        self.inner.work_done(id, result)
    }
}

fn config() -> Config {
    Config {
        eager_threshold: Some(4096),
        fragment_size: Some(Config::default().default_fragment_size),
        probe: false,
        ..Config::default()
    }
}

/// A connection pair over tcp whose first end runs on a [`Holding`] link.
async fn pair(hold: Option<u32>) -> (Connection, Connection, Arc<Mutex<Log>>) {
    let cfg = config();
    let l = tcp::listen("127.0.0.1:0", &cfg).await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (s, c) = tokio::join!(l.accept(), tcp::connect(&addr, &cfg));
    let log = Arc::new(Mutex::new(Log::default()));
    let held = Holding {
        inner: s.unwrap(),
        hold,
        log: log.clone(),
    };
    let (a, b) = tokio::join!(
        Connection::establish(Box::new(held), &cfg),
        Connection::establish(Box::new(c.unwrap()), &cfg)
    );
    (a.unwrap(), b.unwrap(), log)
}

fn message(i: u8) -> Bytes {
    Bytes::from(vec![i; if i.is_multiple_of(2) { 10 } else { 100_000 }])
}

/// Sends 20 messages from `a`, closes it, and checks that `b` gets them all, then the end.
async fn close_and_deliver(a: &Connection, b: &Connection) {
    for i in 0..20u8 {
        a.send(message(i)).await.unwrap();
    }
    let reader = async {
        for i in 0..20u8 {
            assert_eq!(b.recv().await.expect("message before the end"), message(i));
        }
        b.recv().await.expect_err("the end")
    };
    let (_, end) = tokio::time::timeout(GUARD, async { tokio::join!(a.close(), reader) })
        .await
        .expect("the close finishes: no hang");
    assert!(matches!(end, Error::PeerClosed(_)), "{end}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_link_is_flushed_before_it_is_dropped() {
    let (a, b, log) = pair(Some(3)).await;
    close_and_deliver(&a, &b).await;
    let log = log.lock().unwrap();
    assert!(
        log.closed && log.flushed_after_close && log.dropped,
        "{log:?}"
    );
    assert!(!log.dropped_unflushed, "{log:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_that_never_flushes_is_dropped_after_the_linger() {
    let (a, b, log) = pair(None).await;
    close_and_deliver(&a, &b).await;
    let log = log.lock().unwrap();
    assert!(
        log.closed && log.dropped && log.dropped_unflushed,
        "{log:?}"
    );
}
