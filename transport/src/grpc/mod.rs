//! gRPC over Ibex: a tonic-compatible client [`Channel`] and [`Server`] that carry calls as
//! Ibex messages instead of HTTP/2 frames. Generated tonic clients and servers work unchanged:
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use ibex_transport::grpc::{Channel, Server};
//! # let svc = tonic::service::Routes::default();
//! // Server: any tonic service (or `Routes`).
//! tokio::spawn(Server::builder().add_routes(svc).serve_uri("shm:///run/ibex.sock"));
//! // Client: `GreeterClient::new(channel)`, `BenchClient::new(channel)`, ...
//! let channel = Channel::connect("shm:///run/ibex.sock").await?;
//! # Ok(()) }
//! ```
//!
//! Each call is `HEAD *DATA [TRAILERS|END]` each way (`wire.rs`); many calls share one
//! connection, and flow control is per call, so a slow reader of one call never stalls the
//! others. What HTTP/2 and tonic's server layer did is done here: `grpc-timeout` deadlines,
//! cancellation, trailers-only responses and graceful shutdown. A handler can pull a buffer
//! the client exposed ([`Channel::expose`]) with the [`PeerHandle`] in the request's extensions.

mod balance;
mod body;
pub(crate) mod calls;
mod client;
pub(crate) mod demux;
mod direct;
mod endpoint;
pub(crate) mod pump;
mod router;
pub mod server;
mod tls;
pub(crate) mod wire;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;

pub use body::IncomingBody;
pub use client::Channel;
pub use direct::{DirectClient, DirectRoute, UnaryFuture};
pub use endpoint::Endpoint;
pub use router::{AddService, Generated, Services, Tower};
pub use server::{Builder, ConnectInfo, PeerHandle, RouteCounts, Server, ServerStats};
pub use tls::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// The channel's types under tonic's paths (`tonic::transport::channel::Change`).
pub mod channel {
    pub use super::{Channel, Endpoint};
    pub use tower::discover::Change;
}

pub use crate::conn::RemoteBuf;

use crate::conn::Connection;
use crate::error::{Error, Result};
use body::{READ_BUDGET, ReadSource};
use pump::Side;
use tonic::Status;
use wire::{Data, FrameBuf, FrameWriter, PACKET_ROOM, Packet, Trailers};

/// The body of a response on the client side: data frames, then the trailers.
pub type ResponseBody = IncomingBody;

/// Per-call flow-control window, in bytes, each direction. A sender may send while its window
/// is positive, so one message larger than the window still goes (alone).
const WINDOW: i64 = 8 << 20;

/// The largest piece a large body frame is cut into.
pub(crate) const MAX_PIECE: usize = 8 << 20;

/// The smallest piece: below it, per-message work outweighs what overlapping the pieces'
/// reads wins.
const MIN_PIECE: usize = 1 << 20;

/// Each frame counts at least this much against the window, so a stream of tiny frames is
/// bounded in count too.
const MIN_FRAME_COST: i64 = 1024;

fn cost(len: usize) -> i64 {
    (len as i64).max(MIN_FRAME_COST)
}

/// One connection's sending side. A packet and its body frame are one transport message
/// (inline, or a two-part message: [`Connection::send_parts`]), so sends need no lock.
pub(crate) struct Mux {
    conn: Connection,
    side: Side,
}

/// A packet [`Mux::send_now`] could not send at once.
pub(crate) struct Encoded {
    call: u32,
    head: Bytes,
    body: Option<Bytes>,
}

impl Encoded {
    fn len(&self) -> usize {
        self.head.len() + self.body.as_ref().map_or(0, Bytes::len)
    }

    async fn send(self, mux: &Mux) -> Result<()> {
        mux.send_encoded(self.call, self.head, self.body).await
    }
}

/// The status a call gets when the transport refuses one of its messages.
fn transport_status(e: &Error) -> Status {
    match e {
        Error::TooLarge { .. } => Status::resource_exhausted(format!(
            "gRPC message frame refused by the Ibex transport: {e}"
        )),
        _ => Status::unavailable(format!("the Ibex connection failed: {e}")),
    }
}

impl Mux {
    fn new(conn: Connection, side: Side) -> Mux {
        Mux { conn, side }
    }

    /// The largest body frame copied into its packet, and the piece size of large frames.
    /// A body rides in its packet while the packet stays eager: one message each way. Pieces
    /// are two rendezvous fragments, so each piece's read is pipelined, within
    /// [`MIN_PIECE`]..=[`MAX_PIECE`].
    fn sizes(&self) -> (usize, usize) {
        let (threshold, fragment) = self.conn.message_sizes();
        (
            threshold.saturating_sub(PACKET_ROOM),
            (2 * fragment).clamp(MIN_PIECE, MAX_PIECE),
        )
    }

    fn inline_max(&self) -> usize {
        self.sizes().0
    }

    /// Encodes `pkt` with `data` as its body frame (see [`attach`]): the packet, and the
    /// body frame when it goes as the second part of a two-part message.
    fn encode(&self, mut pkt: Packet, data: Option<Bytes>) -> Result<(Bytes, Option<Bytes>)> {
        pkt.compact = true;
        let next = attach(&mut pkt, data, self.inline_max());
        let head = pkt.encode()?;
        match next {
            // Inline after all where the packet then still goes eager (an inline length
            // takes 4 bytes, a separate one 8), or is too long for the frame announcing a
            // two-part message (a large head, or a peer without two-part messages).
            Some(body)
                if head.len() + body.len() <= self.conn.eager_threshold() + 4
                    || head.len() > self.conn.head_room() =>
            {
                pkt.data = Some(Data::Inline(body));
                Ok((pkt.encode()?, None))
            }
            next => Ok((head, next)),
        }
    }

    /// Sends `pkt` with `data` as its body frame. Encoded before the future is made, so the
    /// future (inside every call's) holds bytes, not the packet.
    fn send(&self, pkt: Packet, data: Option<Bytes>) -> impl Future<Output = Result<()>> + '_ {
        let call = pkt.call;
        let encoded = self.encode(pkt, data);
        async move {
            let (head, body) = encoded?;
            self.send_encoded(call, head, body).await
        }
    }

    /// Sends a packet of call `call` that [`Mux::encode`] made.
    async fn send_encoded(&self, call: u32, head: Bytes, body: Option<Bytes>) -> Result<()> {
        let Some(body) = body else {
            return self.conn.send(head).await;
        };
        let sent = self.conn.send_parts(head, body).await;
        // Refused whole (too large for the peer, a failed registration): the peer saw none
        // of it and learns that this call failed; other calls go on.
        if let Err(e) = &sent {
            let mut abort = Packet::new(call);
            match self.side {
                Side::Client => abort.reset = true,
                Side::Server => {
                    abort.trailers =
                        Some(Trailers::map(pump::status_trailers(&transport_status(e))))
                }
            }
            if let Ok(a) = abort.encode() {
                let _ = self.conn.send(a).await;
            }
        }
        sent
    }

    /// Sends `pkt` and its body frame now if they make one message and the transport's
    /// queue has room; otherwise returns them encoded, for [`Mux::send_encoded`].
    fn send_now(&self, pkt: Packet, data: Option<Bytes>) -> Result<Option<Encoded>> {
        let call = pkt.call;
        let (head, body) = self.encode(pkt, data)?;
        if body.is_some() {
            return Ok(Some(Encoded { call, head, body }));
        }
        Ok(self
            .conn
            .try_send(head)?
            .map(|head| Encoded { call, head, body }))
    }

    /// [`Mux::send_now`] for a frame with room for its packet: inline, the packet is written
    /// around it ([`Packet::encode_around`]) instead of copying it.
    fn send_framed_now(&self, mut pkt: Packet, data: FrameBuf) -> Result<Option<Encoded>> {
        // (`inline_max` locks the connection's state: asked only for frames with room.)
        if !data.has_room() || data.len() > self.inline_max() {
            return self.send_now(pkt, Some(data.into_bytes()));
        }
        let call = pkt.call;
        pkt.compact = true;
        let head = pkt.encode_around(data)?;
        Ok(self.conn.try_send(head)?.map(|head| Encoded {
            call,
            head,
            body: None,
        }))
    }

    /// [`Mux::send_now`] for a frame that writes itself, straight into the packet if inline.
    fn send_written_now(&self, pkt: Packet, frame: &dyn FrameWriter) -> Result<Option<Encoded>> {
        if frame.len() > self.inline_max() {
            return match FrameBuf::from_writer(frame)? {
                FrameBuf::Plain(data) => self.send_now(pkt, Some(data)),
                data => self.send_framed_now(pkt, data),
            };
        }
        self.send_inline_written_now(pkt, frame)
    }

    /// [`Mux::send_written_now`] for a frame known to be within [`Mux::inline_max`].
    fn send_inline_written_now(
        &self,
        mut pkt: Packet,
        frame: &dyn FrameWriter,
    ) -> Result<Option<Encoded>> {
        pkt.compact = true;
        let head = pkt.encode_written(frame)?;
        let sent = self.send_encoded_now(pkt.call, head);
        // Dropped (its head's map) once the bytes are on their way: the peer works meanwhile.
        drop(pkt);
        sent
    }

    /// Sends call `call`'s encoded packet, or hands it back when the link has no room now.
    fn send_encoded_now(&self, call: u32, head: Bytes) -> Result<Option<Encoded>> {
        let unsent = self.conn.try_send(head)?;
        Ok(unsent.map(|head| Encoded {
            call,
            head,
            body: None,
        }))
    }

    /// Resets call `id` on the peer from a context that cannot wait (a drop), once the
    /// call's head has gone out; nothing if it never will.
    fn reset_detached(self: &Arc<Self>, id: u32, call: Arc<CallShared>) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let mux = self.clone();
            rt.spawn(async move {
                call.head_sent.wait().await;
                if call.head_skipped.load(Ordering::Acquire) {
                    return;
                }
                let mut p = Packet::new(id);
                p.reset = true;
                if let Err(e) = mux.send(p, None).await {
                    tracing::debug!(%e, "gRPC reset not sent: the connection is closing");
                }
            });
        }
    }

    /// Sends a packet from a context that cannot wait (drops, poll functions).
    fn send_detached(self: &Arc<Self>, pkt: Packet) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let mux = self.clone();
            rt.spawn(async move {
                if let Err(e) = mux.send(pkt, None).await {
                    tracing::debug!(%e, "gRPC control packet not sent: the connection is closing");
                }
            });
        }
    }
}

/// Puts `data` in `pkt` as its body frame when it is at most `inline_max` bytes; a larger
/// one is announced in the packet and returned, to go as the second part of its message.
#[inline]
pub(crate) fn attach(pkt: &mut Packet, data: Option<Bytes>, inline_max: usize) -> Option<Bytes> {
    match data {
        Some(d) if d.len() > inline_max => {
            pkt.data = Some(Data::Next(d.len() as u64));
            Some(d)
        }
        Some(d) => {
            pkt.data = Some(Data::Inline(d));
            None
        }
        None => None,
    }
}

/// Waits for `fut`, reading the connection from `src` meanwhile, so that what `fut` waits
/// for arrives without a reader task (whoever waits, reads).
pub(crate) async fn read_while<F: Future>(src: &dyn ReadSource, fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx| {
        // `fut` is polled with a no-op waker while this task reads for it: waking the running
        // task re-queues it as a yield (and wakes an idle worker to steal it). The real waker
        // goes to `fut` last, before the task sleeps.
        let mut quiet = Context::from_waker(std::task::Waker::noop());
        for _ in 0..READ_BUDGET {
            if let Poll::Ready(v) = fut.as_mut().poll(&mut quiet) {
                return Poll::Ready(v);
            }
            match src.poll_read(cx) {
                Poll::Ready(true) => {}
                // Closed, or nothing to read: `fut` takes the real waker (and may be ready).
                Poll::Ready(false) | Poll::Pending => return fut.as_mut().poll(cx),
            }
        }
        // Other calls' traffic kept coming: let the runtime run their tasks, then go on.
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}

/// A one-way latch tasks can wait on (call finished or cancelled, server shutting down).
#[derive(Default)]
pub(crate) struct Flag {
    set: AtomicBool,
    /// Someone may be in `wait`: only then does `set` wake anyone. Most flags (a unary
    /// call's) are never waited on, and `notify_waiters` takes a lock every time.
    waited: AtomicBool,
    notify: Notify,
}

impl Flag {
    fn set(&self) {
        // SeqCst on both sides, store then load (here and in `wait`): either `wait` sees
        // the flag set, or this sees a waiter whose wake-up is already registered.
        self.set.store(true, Ordering::SeqCst);
        if self.waited.load(Ordering::SeqCst) {
            self.notify.notify_waiters();
        }
    }

    fn is_set(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    async fn wait(&self) {
        loop {
            let n = self.notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            self.waited.store(true, Ordering::SeqCst);
            if self.set.load(Ordering::SeqCst) {
                return;
            }
            n.await;
        }
    }
}

/// What both ends track for one call.
pub(crate) struct CallShared {
    /// The call is over for this side: finished, cancelled or its connection is gone.
    done: Flag,
    /// Bytes this side may still send before the peer grants more.
    send_window: std::sync::Mutex<i64>,
    send_space: Notify,
    /// A sender may be waiting for window (`acquire`): only then do a grant and the end
    /// wake anyone, as in [`Flag`].
    space_waited: AtomicBool,
    /// Bytes received but not yet granted back; the peer never lets this pass `WINDOW`.
    recv_outstanding: AtomicI64,
    /// The call's first packet went out, or never will (`head_skipped`): a cancel must not
    /// overtake the head, or the peer would see a reset for a call it does not know yet.
    head_sent: Flag,
    head_skipped: AtomicBool,
    /// Client side: where the response head is left for the caller ([`client::HeadTx`]); a
    /// channel of its own would cost an allocation a call.
    head: std::sync::Mutex<client::HeadSlot>,
}

impl CallShared {
    pub(crate) fn new() -> Arc<CallShared> {
        Arc::new(CallShared {
            done: Flag::default(),
            send_window: std::sync::Mutex::new(WINDOW),
            send_space: Notify::new(),
            space_waited: AtomicBool::new(false),
            recv_outstanding: AtomicI64::new(0),
            head_sent: Flag::default(),
            head_skipped: AtomicBool::new(false),
            head: Default::default(),
        })
    }

    /// Ends the call for this side and wakes everything waiting on it.
    fn finish(&self) {
        self.done.set();
        self.wake_senders();
    }

    fn grant(&self, n: u32) {
        if let Ok(mut w) = self.send_window.lock() {
            // Saturating: a peer granting u32::MAX over and over must not wrap the window.
            *w = w.saturating_add(i64::from(n));
        }
        self.wake_senders();
    }

    /// After the window or the end changed. A sender in `acquire` announced itself before
    /// looking at either (SeqCst store, then the window's lock or a SeqCst load), so it saw
    /// the change or is seen here.
    fn wake_senders(&self) {
        if self.space_waited.load(Ordering::SeqCst) {
            self.send_space.notify_waiters();
        }
    }

    /// Takes `len` bytes of window if any is left (a frame larger than the window goes alone).
    fn try_acquire(&self, len: usize) -> bool {
        match self.send_window.lock() {
            Ok(mut w) if *w > 0 => {
                *w -= cost(len);
                true
            }
            _ => false,
        }
    }

    /// Waits for window, then takes `len` bytes of it. False once the call is over.
    async fn acquire(&self, len: usize) -> bool {
        loop {
            let n = self.send_space.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            self.space_waited.store(true, Ordering::SeqCst);
            if self.done.set.load(Ordering::SeqCst) {
                return false;
            }
            if self.try_acquire(len) {
                return true;
            }
            n.await;
        }
    }

    /// Accounts a received frame. False if the peer overran the window it was given.
    fn received(&self, len: usize) -> bool {
        let before = self.recv_outstanding.fetch_add(cost(len), Ordering::AcqRel);
        before < WINDOW
    }

    /// Accounts `len` bytes the reader took; `consumed` is the reader's count not yet given
    /// back. Returns the window to grant the sender, once half a window has gone by, so a
    /// sender never stalls on a reader that keeps up.
    fn consumed(&self, consumed: &mut i64, len: usize) -> Option<u32> {
        *consumed += cost(len);
        if *consumed < WINDOW / 2 {
            return None;
        }
        let grant = (*consumed).min(i64::from(u32::MAX));
        *consumed -= grant;
        self.recv_outstanding.fetch_sub(grant, Ordering::AcqRel);
        Some(grant as u32)
    }
}

/// Parses `grpc-timeout` (`1-8 digits` + `H M S m u n`), as tonic's own server does.
fn parse_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    timeout_value(headers.get(wire::GRPC_TIMEOUT)?)
}

/// A `grpc-timeout` value (the first one, where a request has several), as tonic reads it:
/// `None` for one it cannot parse.
fn timeout_value(v: &http::HeaderValue) -> Option<Duration> {
    let v = v.to_str().ok()?;
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeout_parses_like_tonic() {
        let t = |v: &'static str| {
            let mut h = http::HeaderMap::new();
            h.insert("grpc-timeout", http::HeaderValue::from_static(v));
            parse_timeout(&h)
        };
        assert_eq!(t("3H"), Some(Duration::from_secs(3 * 3600)));
        assert_eq!(t("2M"), Some(Duration::from_secs(120)));
        assert_eq!(t("10S"), Some(Duration::from_secs(10)));
        assert_eq!(t("200m"), Some(Duration::from_millis(200)));
        assert_eq!(t("7u"), Some(Duration::from_micros(7)));
        assert_eq!(t("99999999n"), Some(Duration::from_nanos(99_999_999)));
        assert_eq!(t("123456789S"), None, "at most 8 digits");
        assert_eq!(t("5x"), None);
        assert_eq!(t("S"), None);
        assert_eq!(t("-1S"), None);
        assert_eq!(parse_timeout(&http::HeaderMap::new()), None);
    }

    #[tokio::test]
    async fn window_blocks_until_granted_and_releases_on_finish() {
        let c = CallShared::new();
        assert!(
            c.acquire(WINDOW as usize + 5).await,
            "one oversized frame goes while the window is positive"
        );
        let c2 = c.clone();
        let waiter = tokio::spawn(async move { c2.acquire(10).await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        c.grant(u32::MAX);
        assert!(waiter.await.unwrap());
        let c3 = c.clone();
        *c.send_window.lock().unwrap() = 0;
        let waiter = tokio::spawn(async move { c3.acquire(10).await });
        tokio::task::yield_now().await;
        c.finish();
        assert!(
            !waiter.await.unwrap(),
            "a finished call stops waiting for window"
        );
    }

    #[test]
    fn receive_window_overrun_is_detected() {
        let c = CallShared::new();
        assert!(c.received(WINDOW as usize - 1));
        assert!(
            c.received(100),
            "the frame that crosses the window is allowed"
        );
        assert!(!c.received(1), "the sender had no window left");
    }
}
