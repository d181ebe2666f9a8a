//! The user-facing API: [`Connection`], [`Listener`], [`listen`], [`connect`],
//! [`connect_auto`]. A connection moves whole messages, in order, intact; many tasks may send
//! at once. Besides `send(Bytes)` / `recv()`, it sends from and receives into buffers the
//! caller owns ([`Connection::send_owned`], [`Connection::recv_into`]) and offers one-sided
//! access to peer buffers ([`Connection::expose`], [`Connection::read_remote`]): the
//! zero-copy paths the parameter server uses.

mod accept;
mod addr;
mod driver;
mod home;
mod malloc;
mod stats;

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::oneshot;

pub use addr::{Addr, auto_shm_path, is_local_host};
pub use malloc::keep_freed_memory;
pub use stats::ConnStats;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::link::{Link, RecvBuf, Work};
use crate::pool::{Pool, PoolBufMut};
use driver::{Driver, Posted, ReadyMsg, Released, Shared, State, Take, join_parts};

/// One message connection. Cheap to clone; the connection closes gracefully when the last
/// clone is dropped (or at [`Connection::close`]).
#[derive(Clone)]
pub struct Connection {
    handle: Arc<Handle>,
}

struct Handle {
    shared: Arc<Shared>,
    /// The serve thread's runtime the connection was set up on (its driver runs there);
    /// `None` on the application's runtime.
    home: Option<tokio::runtime::Handle>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.shared.lock().close_requested = true;
        self.shared.wake_driver();
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.shared().lock();
        f.debug_struct("Connection")
            .field("provider", &st.info.provider)
            .field("peer", &st.info.peer)
            .finish()
    }
}

impl Connection {
    /// Runs a connection over a link a provider has set up, and waits for the handshake.
    /// Providers' `connect`/`accept` wrappers call this; it is public so that a provider
    /// outside this crate can be plugged in.
    pub async fn establish(link: Box<dyn Link>, config: &Config) -> Result<Connection> {
        config.validate()?;
        let info = link.info();
        let config = &info.caps().tune(config);
        let probe = config.wants_probe();
        let probe_len = config.probe_buffer_len();
        // The probe's rendezvous samples read a zero buffer. One per length for the whole
        // process, so that where exposing means registering (verbs) every connection after
        // the first finds it registered; that first registration runs here, off the runtime.
        let probe_buf = probe.then(|| probe_buffer(probe_len));
        if let (Some(buf), Some(r)) = (&probe_buf, &info.registrar)
            && r.would_register(buf)
        {
            let (buf, r) = (buf.clone(), r.clone());
            if let Err(e) = blocking(move || r.prepare(&buf)).await {
                tracing::warn!(%e, "threshold probe: registering its buffer failed");
            }
        }
        let now = Instant::now();
        let core = crate::proto::Connection::new(config, now);
        let shared = Arc::new_cyclic(|weak| {
            let mut state = State::new(core, link, weak.clone());
            // With no spin budget, a receiver's request to spin would only wake the driver
            // for nothing.
            state.busy_poll = !config.spin.is_zero();
            state.inline.spin = config.spin;
            if let Some(buf) = probe_buf
                && let Some(link) = state.link.as_mut()
            {
                match link.expose(buf) {
                    Ok(exp) => {
                        state.core.start_probe(now, exp.descriptor, probe_len);
                        state.set_probe_exposure(exp.id);
                    }
                    Err(e) => {
                        tracing::warn!(%e, "threshold probe skipped: could not expose its buffer")
                    }
                }
            }
            Shared {
                state: std::sync::Mutex::new(state),
                driver_waker: Default::default(),
                changed: tokio::sync::Notify::new(),
                send_space: tokio::sync::Notify::new(),
                released: std::sync::Mutex::new(Vec::new()),
                recv_lock: tokio::sync::Mutex::new(()),
                readers: std::sync::Mutex::new(Vec::new()),
                registers: info.registrar.is_some(),
            }
        });
        tokio::spawn(Driver::new(shared.clone(), config.spin));
        let conn = Connection {
            handle: Arc::new(Handle {
                shared,
                home: home::current(),
            }),
        };
        match tokio::time::timeout(config.handshake_timeout, conn.wait_established()).await {
            Ok(r) => r?,
            Err(_) => {
                let why = format!(
                    "no protocol handshake from the peer within {} ms: is it an Ibex endpoint of the same version? (Config::handshake_timeout, IBEX_HANDSHAKE_TIMEOUT_MS)",
                    config.handshake_timeout.as_millis()
                );
                // Tell the peer, briefly: before the handshake the close goes out at once.
                let _ = tokio::time::timeout(Duration::from_secs(1), conn.close_with(&why)).await;
                return Err(Error::Timeout(why));
            }
        }
        Ok(conn)
    }

    /// The serve thread's runtime the connection was set up on, where its driver runs
    /// and its other tasks belong ([`Config::serve_threads`]); `None` for a connection that
    /// lives on the application's runtime.
    pub(crate) fn home(&self) -> Option<&tokio::runtime::Handle> {
        self.handle.home.as_ref()
    }

    /// Spawns `fut` where this connection lives: on its serve thread when a listener put
    /// it on one ([`Config::serve_threads`]), so a loop that serves the connection runs
    /// beside its driver and no other thread takes either; on the current runtime
    /// otherwise.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match self.home() {
            Some(home) => home.spawn(fut),
            None => tokio::spawn(fut),
        }
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.handle.shared
    }

    async fn wait_established(&self) -> Result<()> {
        loop {
            let notified = self.shared().changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.shared().lock();
                if let Some(e) = &st.closed {
                    return Err(e.clone());
                }
                if st.core.is_established() {
                    return Ok(());
                }
            }
            notified.await;
        }
    }

    /// Sends one whole message. It returns once the message is queued; a rendezvous
    /// message's buffer is held (not copied) until the peer has read it. Waits while the
    /// send queue is full (backpressure).
    pub async fn send(&self, msg: Bytes) -> Result<()> {
        self.send_inner(msg, None).await
    }

    /// Like [`Connection::send`], but returns only once the peer has the data (for
    /// rendezvous messages: once it has finished reading the buffer).
    pub async fn send_wait(&self, msg: Bytes) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.send_inner(msg, Some(tx)).await?;
        rx.await.map_err(|_| Error::LocallyClosed)?
    }

    /// Sends straight from a buffer the caller owns and hands it back once the peer is done
    /// with it. Large messages are read by the peer from this buffer (no copy on this side;
    /// none at all for registered-pool buffers on shm). Eager-sized ones are copied into a
    /// slot anyway, so they are copied and the buffer comes back at once; so are, on verbs,
    /// unregistered ones up to 1 MiB, copied into registered memory (see
    /// [`crate::proto::COPY_MAX`]).
    pub async fn send_owned<B>(&self, buf: B) -> Result<B>
    where
        B: AsRef<[u8]> + Send + Sync + 'static,
    {
        let len = buf.as_ref().len() as u64;
        if self.shared().lock().core.classify(len)? == crate::proto::Protocol::Eager {
            self.send(Bytes::copy_from_slice(buf.as_ref())).await?;
            return Ok(buf);
        }
        let owner = Arc::new(buf);
        let msg = Bytes::from_owner(SharedOwner(owner.clone()));
        let range = (msg.as_ptr() as usize, msg.len());
        self.send_wait(msg).await?;
        // A registration cache may keep its own reference with the registration (verbs):
        // the caller gets the buffer back, so that registration goes now (off the runtime).
        let registrar = self.shared().lock().info.registrar.clone();
        if let Some(r) = registrar {
            blocking(move || {
                r.forget(range.0, range.1);
                Ok(())
            })
            .await?;
        }
        // The peer's RndvDone withdrew the exposure, which held the only other reference.
        Arc::try_unwrap(owner).map_err(|_| {
            Error::Protocol("send_owned: buffer still referenced after the peer released it".into())
        })
    }

    async fn send_inner(
        &self,
        msg: Bytes,
        done: Option<oneshot::Sender<Result<()>>>,
    ) -> Result<()> {
        let msg = self.stage(msg)?;
        self.enqueue(|st, now| st.send(now, msg, done)).await
    }

    /// Sends one message made of two parts: `head` travels in the frame that announces the
    /// message, and `body` follows by rendezvous, read by the peer from this buffer (no copy
    /// on this side, whatever its size). The peer's [`Connection::recv_parts`] gets the two
    /// parts as they were sent; [`Connection::recv`] gets them joined. For a small header
    /// in front of a large payload (the gRPC layer's packet and its body frame) without
    /// copying either. `head` may be at most [`Connection::head_room`] bytes: a longer one
    /// is refused (`Error::TooLarge`) before anything is queued.
    pub async fn send_parts(&self, head: Bytes, body: Bytes) -> Result<()> {
        let body = self.stage_as(body, crate::proto::Protocol::Rendezvous)?;
        self.enqueue(|st, now| st.send_parts(now, head, body)).await
    }

    /// The longest head [`Connection::send_parts`] takes now: what the peer's receive slot
    /// holds beside the announcing frame, or 0 when the peer's build does not take two-part
    /// messages.
    pub fn head_room(&self) -> usize {
        self.shared().lock().core.head_room()
    }

    /// Puts a message where the provider can expose it without registering per message
    /// (verbs); returns it unchanged elsewhere. Synchronous, before any queueing: callers
    /// rely on a send that was polled once being queued in call order and not cut off
    /// half-way by cancellation.
    fn stage(&self, msg: Bytes) -> Result<Bytes> {
        self.stage_as(msg, None)
    }

    /// [`Connection::stage`] for a message that goes by `protocol` (`None`: whatever its
    /// size makes it).
    fn stage_as(
        &self,
        msg: Bytes,
        protocol: impl Into<Option<crate::proto::Protocol>>,
    ) -> Result<Bytes> {
        let shared = self.shared();
        if !shared.registers {
            return Ok(msg);
        }
        let protocol = protocol.into();
        // The core decides (`LinkCaps::staging`); this carries its decision out.
        let (staging, registrar) = {
            let st = shared.lock();
            let p = protocol.or_else(|| st.core.classify(msg.len() as u64).ok());
            match (st.info.registrar.clone(), p) {
                (Some(r), Some(p)) => (
                    st.core
                        .link()
                        .staging(p, msg.len(), || r.would_register(&msg)),
                    r,
                ),
                _ => return Ok(msg),
            }
        };
        match staging {
            crate::proto::Staging::AsIs => Ok(msg),
            crate::proto::Staging::Copy => {
                if let Some(mut b) = registrar.try_alloc(msg.len()) {
                    // Usually a slab has room, and nothing here blocks.
                    b.copy_from_slice(&msg);
                    return Ok(b.freeze());
                }
                // No room: growing the slabs registers, so it runs off the runtime; where
                // no slab can be had, the message is registered after all.
                outside_runtime(|| -> Result<Bytes> {
                    let mut b = registrar.alloc(msg.len())?;
                    b.copy_from_slice(&msg);
                    Ok(b.freeze())
                })
                .or_else(|_| outside_runtime(|| registrar.prepare(&msg)).map(|()| msg))
            }
            crate::proto::Staging::Register => {
                outside_runtime(|| registrar.prepare(&msg))?;
                Ok(msg)
            }
        }
    }

    /// Waits until the send queue has room (or the connection closed), then runs `queue`
    /// under the connection's lock and hands what it queued to the link right there: no
    /// task switch to the driver when the link takes it at once.
    async fn enqueue(&self, queue: impl FnOnce(&mut State, Instant) -> Result<()>) -> Result<()> {
        let shared = self.shared();
        let mut queue = Some(queue);
        // First without registering for space: the queue is almost never full, and a
        // `Notify` registration is two more lock round trips on every send.
        let mut registered = false;
        loop {
            let space = shared.send_space.notified();
            tokio::pin!(space);
            if registered {
                space.as_mut().enable();
            }
            {
                let st = shared.lock();
                if !st.queue_full() || st.closed.is_some() {
                    let Some(queue) = queue.take() else {
                        return Err(Error::LocallyClosed);
                    };
                    return queue_now(shared, st, queue);
                }
            }
            if !registered {
                // Full: look again once registered, so space made in between is not missed.
                registered = true;
                continue;
            }
            shared.wake_driver();
            space.await;
        }
    }

    /// Queues `msg` if the send queue has room now, without waiting; hands it back when the
    /// queue is full (then [`Connection::send`] waits for room). For callers that finish
    /// their work in one poll and would otherwise keep a send future for the rare full
    /// queue (the gRPC server's answer to a call whose handler is ready at once).
    pub(crate) fn try_send(&self, msg: Bytes) -> Result<Option<Bytes>> {
        let msg = self.stage(msg)?;
        let shared = self.shared();
        let st = shared.lock();
        if st.queue_full() && st.closed.is_none() {
            return Ok(Some(msg));
        }
        queue_now(shared, st, |st, now| st.send(now, msg, None)).map(|()| None)
    }

    /// Receives the next message. After the connection closed, returns why.
    pub async fn recv(&self) -> Result<Bytes> {
        self.recv_parts().await.map(join_parts)
    }

    /// Receives the next message as it was sent: its bytes and `None`, or a two-part
    /// message's head and body ([`Connection::send_parts`]), neither copied to join them.
    pub async fn recv_parts(&self) -> Result<(Bytes, Option<Bytes>)> {
        let shared = self.shared();
        let _order = shared.recv_lock.lock().await;
        loop {
            let notified = shared.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            loop {
                match std::future::poll_fn(|cx| Poll::Ready(self.try_take(cx.waker()))).await {
                    Take::Got(r) => return r,
                    Take::Spin(yield_os) => {
                        if yield_os {
                            std::thread::yield_now();
                        }
                        yield_once().await
                    }
                    Take::Wait => break,
                }
            }
            notified.await;
        }
    }

    /// Polls for the next message, for callers that read from inside `poll` functions and
    /// must not hold a receive lock while they are not being polled: any number of tasks may
    /// poll at once, each message goes to exactly one of them, and all are woken when
    /// messages arrive (whoever waits, reads). Does not mix with a concurrent
    /// [`Connection::recv_into`], whose posted buffer expects the next message.
    pub fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Result<Bytes>> {
        self.poll_recv_parts(cx).map_ok(join_parts)
    }

    /// [`Connection::poll_recv`] that gives a two-part message as its two parts, as
    /// [`Connection::recv_parts`] does.
    pub fn poll_recv_parts(&self, cx: &mut Context<'_>) -> Poll<Result<(Bytes, Option<Bytes>)>> {
        // Register before looking, so a delivery between the two still wakes this task.
        {
            let mut readers = self
                .shared()
                .readers
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if !readers.iter().any(|w| w.will_wake(cx.waker())) {
                readers.push(cx.waker().clone());
            }
        }
        match self.try_take(cx.waker()) {
            Take::Got(r) => Poll::Ready(r),
            Take::Spin(yield_os) => {
                // Spinning cooperatively: back to the runtime, which runs whatever else
                // is ready on this thread (the handler that will produce the reply may be
                // one), then polls this task again; now and then the core goes back to
                // the OS too.
                if yield_os {
                    std::thread::yield_now();
                }
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Take::Wait => Poll::Pending,
        }
    }

    /// Takes the next delivered message, or the reason the connection closed, for a task
    /// that wakes with `me`; reads the link itself where that pays ([`State::take`]).
    fn try_take(&self, me: &std::task::Waker) -> Take {
        let shared = self.shared();
        loop {
            let (take, driver, others, space, work) = {
                let mut st = shared.lock();
                let (take, driver, others) = st.take(me);
                let space = std::mem::take(&mut st.space_freed);
                (
                    take,
                    driver,
                    others,
                    space,
                    std::mem::take(&mut st.inline_work),
                )
            };
            if space {
                shared.send_space.notify_waiters();
            }
            if driver {
                shared.wake_driver();
            }
            if others {
                shared.notify_changed();
            }
            if work.is_empty() {
                return take;
            }
            // The copies of a message read inline (it came with no message delivered):
            // run here, with the lock released, as the driver would; their completions
            // deliver the message at the next look.
            let done: Vec<_> = work.into_iter().map(Work::run).collect();
            if shared.lock().inline_work_done(done) {
                shared.wake_driver();
            }
        }
    }

    /// Receives the next message into `buf`, returning it with the message length. When
    /// `buf` is posted before a rendezvous message arrives, the data lands in it directly;
    /// otherwise it is copied in. A message larger than `buf` gives
    /// [`Error::BufferTooSmall`] and stays queued for the next receive.
    pub async fn recv_into<B>(&self, buf: B) -> Result<(B, usize)>
    where
        B: AsMut<[u8]> + Send + Sync + 'static,
    {
        let shared = self.shared();
        let _order = shared.recv_lock.lock().await;
        let mut mine: Option<B> = Some(buf);
        let mut my_token = None;
        loop {
            let notified = shared.changed.notified();
            let spin;
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = shared.lock();
                if let Some(ready) = st.delivered.pop_front() {
                    // Take our buffer back if it is still posted.
                    if let (None, Some(tok)) = (&mine, my_token)
                        && st.posted.as_ref().is_some_and(|p| p.token == tok)
                        && let Some(p) = st.posted.take()
                    {
                        mine = p.buf.into_owner().downcast::<B>().ok().map(|b| *b);
                    }
                    let msg = ready.msg();
                    let result = match ready {
                        ReadyMsg::User {
                            buf, len, token, ..
                        } if Some(token) == my_token => match buf.into_owner().downcast::<B>() {
                            Ok(b) => Ok((*b, len)),
                            Err(_) => Err(Error::Protocol(
                                "recv_into: posted buffer changed type".into(),
                            )),
                        },
                        other => {
                            let Some(mut b) = mine.take() else {
                                st.delivered.push_front(other);
                                return Err(Error::Protocol(
                                    "recv_into: lost track of the posted buffer".into(),
                                ));
                            };
                            let dst = b.as_mut();
                            let len = other.len();
                            if dst.len() < len {
                                let err = Error::BufferTooSmall {
                                    buf: dst.len(),
                                    len: len as u64,
                                };
                                // Left as it came, for the next receive of any kind.
                                st.delivered.push_front(other);
                                return Err(err);
                            }
                            // A two-part message's parts go straight to their places.
                            let (first, rest) = other.into_parts();
                            dst[..first.len()].copy_from_slice(&first);
                            if let Some(rest) = rest {
                                dst[first.len()..len].copy_from_slice(&rest);
                            }
                            Ok((b, len))
                        }
                    };
                    let credit_due = st.consume(msg);
                    drop(st);
                    if credit_due {
                        shared.wake_driver();
                    }
                    return result;
                }
                if let Some(e) = &st.closed {
                    return Err(e.clone());
                }
                // Post our buffer so the next rendezvous message can land in it directly.
                if st.posted.is_none()
                    && let Some(b) = mine.take()
                {
                    // Box first so the memory cannot move, even for inline arrays.
                    let mut boxed = Box::new(b);
                    let slice = (*boxed).as_mut();
                    let (ptr, len) = (slice.as_mut_ptr(), slice.len());
                    let token = st.next_token;
                    st.next_token += 1;
                    // SAFETY: `ptr..ptr+len` lies in the boxed caller buffer, which the
                    // RecvBuf owns from here on; moving a Box leaves its heap contents in
                    // place, and nothing else touches the buffer until it is handed back.
                    let rb = unsafe { RecvBuf::from_raw(ptr, len, boxed) };
                    st.posted = Some(Posted { buf: rb, token });
                    my_token = Some(token);
                }
                st.spin_requested = st.busy_poll;
                spin = st.busy_poll;
            }
            // The link wakes the driver when data comes; it only needs a nudge to spin.
            if spin {
                shared.wake_driver();
            }
            notified.await;
        }
    }

    /// Exposes `buf` for one-sided reads by the peer (outside the message flow), until the
    /// returned [`RemoteBuf`] is dropped. Put its descriptor in a message; the peer pulls
    /// with [`Connection::read_remote`].
    pub async fn expose(&self, buf: Bytes) -> Result<RemoteBuf> {
        self.prepare(&buf).await?;
        let exp = self.shared().lock().expose(buf)?;
        Ok(RemoteBuf {
            descriptor: exp.descriptor,
            id: exp.id,
            shared: Arc::downgrade(self.shared()),
        })
    }

    /// Reads the peer buffer named by `descriptor` (from the peer's [`Connection::expose`])
    /// into `dst`, which must be exactly as long as the bytes wanted. One-sided where the
    /// provider can; emulated by the peer's provider otherwise (tcp).
    pub async fn read_remote(&self, descriptor: Bytes, dst: RecvBuf) -> Result<RecvBuf> {
        let registrar = self.shared().lock().info.registrar.clone();
        if let Some(r) = registrar
            && r.recv_would_register(dst.len())
        {
            // Make room for the staging buffer off the runtime; the read takes it under the
            // lock without registering.
            let len = dst.len();
            blocking(move || r.reserve_recv(len)).await?;
        }
        let (tx, rx) = oneshot::channel();
        self.shared().lock().read_remote(&descriptor, dst, tx);
        self.shared().wake_driver();
        rx.await.map_err(|_| Error::LocallyClosed)?
    }

    /// Whether a receiver waiting in `recv` makes the driver busy-poll the link before it
    /// sleeps (on by default when `Config::spin` is not zero; shm only). Worth it when
    /// replies come from another process; harmful when they come from tasks on the
    /// receiver's own runtime, since the spin keeps them from running.
    pub fn set_busy_poll(&self, on: bool) {
        self.shared().lock().busy_poll = on;
    }

    /// True when the provider reads peer memory without the peer's CPU (CMA, RDMA READ).
    pub fn one_sided(&self) -> bool {
        self.shared().lock().info.one_sided
    }

    /// The smallest buffer worth moving by descriptor (the peer reads it with
    /// [`Connection::read_remote`]) rather than inside a message; `None` where reads pass
    /// through a staging buffer (shm without CMA). The core decides
    /// ([`crate::proto::LinkCaps::remote_min`]) from the link's capabilities and this
    /// connection's fragment size and eager threshold (probed or configured): the defaults
    /// give 256 KiB.
    pub fn remote_min(&self) -> Option<usize> {
        let st = self.shared().lock();
        st.core
            .link()
            .remote_min(st.core.fragment_size(), st.core.eager_threshold())
    }

    /// True when exposing memory the provider did not allocate costs a registration (verbs):
    /// memory meant to be exposed again and again is then best taken from
    /// [`Connection::alloc`]. False where any memory is read as cheaply (shm's CMA).
    pub fn exposing_registers(&self) -> bool {
        self.shared().lock().info.registrar.is_some()
    }

    /// The registered pool: buffers from it move with no copy on providers that can map
    /// them (shm). `None` if the provider has none.
    pub fn pool(&self) -> Option<Arc<Pool>> {
        let registrar = {
            let mut st = self.shared().lock();
            if let Some(p) = &st.pool {
                return Some(p.clone());
            }
            match st.info.registrar.clone() {
                Some(r) => r,
                None => {
                    let p = st.link.as_ref().and_then(|l| l.pool());
                    st.pool = p.clone();
                    return p;
                }
            }
        };
        // The first call in the process registers the pool (verbs): outside the lock.
        let p = registrar.pool();
        self.shared().lock().pool = p.clone();
        p
    }

    /// Registers `msg` ahead of its exposure where the provider needs that, on a blocking
    /// thread and outside the connection's lock (the exposure then finds it cached).
    async fn prepare(&self, msg: &Bytes) -> Result<()> {
        let registrar = self.shared().lock().info.registrar.clone();
        if let Some(r) = registrar
            && r.would_register(msg)
        {
            let (m, r) = (msg.clone(), r);
            blocking(move || r.prepare(&m)).await?;
        }
        Ok(())
    }

    /// Allocates a buffer that sends and exposures move with no copy and no registration:
    /// from the registered pool (shm), or from peer-readable slabs registered on demand and
    /// shared by every connection of the process on that device (verbs; may block the
    /// first time a slab must be registered).
    pub fn alloc(&self, len: usize) -> Result<PoolBufMut> {
        let registrar = self.shared().lock().info.registrar.clone();
        if let Some(r) = registrar {
            return r.alloc(len);
        }
        match self.pool() {
            Some(p) => p.alloc(len),
            None => Err(Error::Config("this provider has no registered pool".into())),
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ConnStats {
        let mut st = self.shared().lock();
        // A receiver reading inline may hold the link right now: keep the last counts then.
        if let Some(link) = st.link.as_ref() {
            st.stats.pushes = link.push_stats();
        }
        let mut s = st.stats.clone();
        s.proto = st.core.stats().clone();
        s
    }

    /// `"shm"`, `"tcp"` or `"verbs"`.
    pub fn provider(&self) -> &'static str {
        self.shared().lock().info.provider
    }

    /// Who is on the other end.
    pub fn peer(&self) -> String {
        self.shared().lock().info.peer.clone()
    }

    /// The certificate chain the peer presented in the TLS handshake, its own first
    /// (tcp with [`Config::tls`]); `None` without TLS, or when the peer presented none.
    pub fn peer_certs(&self) -> Option<Arc<Vec<rustls::pki_types::CertificateDer<'static>>>> {
        self.shared()
            .lock()
            .info
            .tls
            .as_ref()
            .and_then(|t| t.peer_certs.clone())
    }

    /// Whether the connection runs over TLS.
    pub fn is_tls(&self) -> bool {
        self.shared().lock().info.tls.is_some()
    }

    /// This side's socket address (tcp); `None` where the provider has none.
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.shared().lock().info.local_addr
    }

    /// What TLS learned of the peer, for the gRPC server's requests.
    #[cfg(feature = "grpc")]
    pub(crate) fn tls_peer(&self) -> Option<Arc<crate::tls::TlsPeer>> {
        self.shared().lock().info.tls.clone()
    }

    /// The eager threshold and the rendezvous fragment size in force (probed, configured or
    /// default), read together.
    pub fn message_sizes(&self) -> (usize, usize) {
        let st = self.shared().lock();
        (st.core.eager_threshold(), st.core.fragment_size())
    }

    /// The eager threshold in force.
    pub fn eager_threshold(&self) -> usize {
        self.shared().lock().core.eager_threshold()
    }

    /// Waits until the threshold probe has finished (returns at once if none runs).
    pub async fn probe_done(&self) -> usize {
        loop {
            let notified = self.shared().changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.shared().lock();
                if !st.probing() || st.closed.is_some() {
                    return st.core.eager_threshold();
                }
            }
            notified.await;
        }
    }

    /// Pings the peer after `interval` without hearing from it and closes the connection
    /// when nothing comes back within `timeout` (see [`Config::keepalive`]); `None` stops
    /// pinging. For connections whose configuration was fixed elsewhere: a server applying
    /// its keep-alive to the connections its listener accepted.
    pub fn set_keepalive(&self, interval: Option<Duration>, timeout: Duration) -> Result<()> {
        if interval.is_some_and(|i| i.is_zero()) || timeout.is_zero() {
            return Err(Error::Config(
                "a keep-alive interval and timeout must be above zero (leave the interval unset to turn pings off)".into(),
            ));
        }
        self.shared()
            .lock()
            .core
            .set_keepalive(Instant::now(), interval, timeout);
        self.shared().wake_driver();
        Ok(())
    }

    /// Resolves once the connection has closed (either side, or a failure), whether or not
    /// anyone reads it: for a reader that has stopped reading on purpose.
    pub async fn closed(&self) {
        loop {
            let notified = self.shared().changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.shared().lock().closed.is_some() {
                return;
            }
            notified.await;
        }
    }

    /// True once the connection has closed (either side, or a failure).
    pub fn is_closed(&self) -> bool {
        self.shared().lock().closed.is_some()
    }

    /// Closes gracefully: queued messages go out and rendezvous reads by the peer finish,
    /// then the peer sees the close. Waits until done.
    pub async fn close(&self) {
        self.close_with("").await
    }

    /// As [`Connection::close`], and the peer's error says `reason`: why this side gave up
    /// on it (a broken protocol above the transport, a deadline), so a bad or slow peer
    /// learns what it did rather than seeing a bare close.
    pub async fn close_with(&self, reason: &str) {
        {
            let mut st = self.shared().lock();
            st.close_requested = true;
            if st.close_reason.is_empty() {
                st.close_reason = reason.to_owned();
            }
        }
        self.shared().wake_driver();
        loop {
            let notified = self.shared().changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.shared().lock().is_finished() {
                return;
            }
            notified.await;
        }
    }
}

/// Runs `queue` under the connection's lock `st` (the send queue has room) and hands what
/// it queued to the link right there: no task switch to the driver when the link takes it
/// at once.
fn queue_now(
    shared: &Arc<Shared>,
    mut st: std::sync::MutexGuard<'_, State>,
    queue: impl FnOnce(&mut State, Instant) -> Result<()>,
) -> Result<()> {
    // One clock read for queueing and sending: at about 25 ns in a VM it costs as much as
    // the rest of handing a small message to shared memory.
    let now = Instant::now();
    let r = queue(&mut st, now);
    let done_inline = r.is_ok() && st.transmit_inline(now) && !st.needs_driver();
    drop(st);
    if !done_inline {
        shared.wake_driver();
    }
    r
}

struct SharedOwner<B>(Arc<B>);

impl<B: AsRef<[u8]>> AsRef<[u8]> for SharedOwner<B> {
    fn as_ref(&self) -> &[u8] {
        (*self.0).as_ref()
    }
}

/// A local buffer exposed to the peer; withdrawn when dropped.
pub struct RemoteBuf {
    descriptor: Bytes,
    id: u64,
    shared: std::sync::Weak<Shared>,
}

impl std::fmt::Debug for RemoteBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteBuf").field("id", &self.id).finish()
    }
}

impl RemoteBuf {
    /// The descriptor to send to the peer.
    pub fn descriptor(&self) -> Bytes {
        self.descriptor.clone()
    }
}

impl Drop for RemoteBuf {
    fn drop(&mut self) {
        if let Some(s) = self.shared.upgrade() {
            s.release(Released::Exposure(self.id));
        }
    }
}

/// Accepts connections on one address.
///
/// Each accepted peer is set up (provider preface, protocol handshake) in a task of its
/// own, under [`Config::handshake_timeout`] and with at most [`Config::max_handshakes`]
/// set-ups at once; a peer that fails or stalls is logged and dropped without delaying any
/// other. At most [`Config::max_connections`] connections stay open at once. Dropping the listener stops accepting, abandons set-ups in progress and removes
/// its shm socket file.
pub struct Listener {
    ready: tokio::sync::Mutex<tokio::sync::mpsc::Receiver<Connection>>,
    acceptors: Vec<tokio::task::JoinHandle<()>>,
    socket_files: Vec<crate::shm::SocketFile>,
    local_uri: String,
    shm_uri: Option<String>,
    tls: bool,
}

impl Drop for Listener {
    fn drop(&mut self) {
        for a in &self.acceptors {
            a.abort();
        }
        // The aborted tasks drop their sockets later, on the runtime; the file goes now, so
        // a new listener on the path never sees it.
        for f in &self.socket_files {
            f.remove();
        }
    }
}

impl Listener {
    fn start(
        sources: Vec<accept::Source>,
        config: Config,
        local_uri: String,
        shm_uri: Option<String>,
    ) -> Listener {
        let (tx, rx) = tokio::sync::mpsc::channel(config.max_handshakes);
        let tls = config.tls.is_some();
        let shared = Arc::new(accept::Shared {
            slots: Arc::new(tokio::sync::Semaphore::new(config.max_handshakes)),
            config,
            ready: tx,
            warnings: Default::default(),
            conns: Default::default(),
        });
        let mut socket_files = Vec::new();
        let mut acceptors = Vec::new();
        for source in sources {
            if let accept::Source::Shm(l) = &source {
                socket_files.push(l.socket_file());
            }
            acceptors.push(tokio::spawn(accept::run(source, shared.clone())));
        }
        Listener {
            ready: tokio::sync::Mutex::new(rx),
            acceptors,
            socket_files,
            tls,
            local_uri,
            shm_uri,
        }
    }

    /// Waits for the next peer that has completed set-up. Peers that fail set-up never
    /// show here (they are logged); an `Err` means the listener itself has stopped.
    /// Cancel-safe: a dropped `accept` loses no connection.
    pub async fn accept(&self) -> Result<Connection> {
        self.ready.lock().await.recv().await.ok_or_else(|| {
            Error::io(
                format!("accepting on {}", self.local_uri),
                std::io::Error::other("the listener's accept tasks have stopped"),
            )
        })
    }

    /// Stops accepting and returns once the listening sockets are closed, so the address
    /// can be bound again at once. A plain drop stops accepting too, but its sockets close
    /// a moment later, when the runtime drops the accept tasks: a server restarted at the
    /// same port in between would find it in use.
    pub async fn close(mut self) {
        let tasks = std::mem::take(&mut self.acceptors);
        for t in &tasks {
            t.abort();
        }
        drop(self);
        for t in tasks {
            // Cancelled, as asked; the task's future (its sockets) is dropped by then. A
            // panic in it was already the listener's end.
            let _ = t.await;
        }
    }

    /// The address peers connect to (for auto listeners, the tcp one; local peers using
    /// [`connect_auto`] find the shm socket from it).
    pub fn local_uri(&self) -> String {
        self.local_uri.clone()
    }

    /// Whether its tcp peers must speak TLS (it was made with [`Config::tls`]).
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// For auto listeners, the shm address local peers use.
    pub fn shm_uri(&self) -> Option<String> {
        self.shm_uri.clone()
    }
}

fn tcp_uri(l: &crate::tcp::TcpListener) -> Result<String> {
    Ok(format!("tcp://{}", l.local_addr()?))
}

/// Listens on `uri`: `shm:///path.sock`, `tcp://host:port` (port 0 picks one),
/// `verbs://host:port`, or `ibex://host:port` ([`listen_auto`]).
pub async fn listen(uri: &str, config: Config) -> Result<Listener> {
    config.validate()?;
    let (source, local, shm) = match Addr::parse(uri)? {
        Addr::Auto(a) => return listen_auto(&a, config).await,
        Addr::Shm(p) => (
            accept::Source::Shm(crate::shm::listen(&p, &config).await?),
            uri.to_string(),
            Some(uri.to_string()),
        ),
        Addr::Tcp(a) => {
            let l = crate::tcp::listen(&a, &config).await?;
            let local = tcp_uri(&l)?;
            (accept::Source::Tcp(l), local, None)
        }
        Addr::Verbs(_) if config.tls.is_some() => {
            return Err(crate::tls::refuse_on_verbs(uri));
        }
        #[cfg(feature = "verbs")]
        Addr::Verbs(a) => {
            let l = crate::verbs::listen(&a, &config).await?;
            let local = format!("verbs://{}", l.local_addr());
            (accept::Source::Verbs(l), local, None)
        }
        #[cfg(not(feature = "verbs"))]
        Addr::Verbs(_) => return Err(verbs_missing(uri)),
    };
    Ok(Listener::start(vec![source], config, local, shm))
}

/// Listens on `host:port` over tcp and, for peers on this host, over shm at
/// [`auto_shm_path`] in [`Config::shm_dir`], so that [`connect_auto`] can pick the best path; and over
/// verbs (bootstrap on port + 1) when this host has an RDMA device.
pub async fn listen_auto(host_port: &str, config: Config) -> Result<Listener> {
    config.validate()?;
    let tcp = crate::tcp::listen(host_port, &config).await?;
    let local = tcp_uri(&tcp)?;
    let port = tcp.local_addr()?.port();
    let path = auto_shm_path(&config.shm_dir, port);
    let shm = crate::shm::listen(&path, &config).await?;
    let mut sources = vec![accept::Source::Tcp(tcp), accept::Source::Shm(shm)];
    listen_auto_verbs(host_port, port, &config, &mut sources).await;
    let shm_uri = format!("shm://{}", path.display());
    Ok(Listener::start(sources, config, local, Some(shm_uri)))
}

/// The verbs side of an auto listener: bootstrap on port + 1, only where a device exists.
#[cfg(feature = "verbs")]
async fn listen_auto_verbs(
    host_port: &str,
    port: u16,
    config: &Config,
    sources: &mut Vec<accept::Source>,
) {
    if !crate::verbs::device_available() {
        return;
    }
    if config.tls.is_some() {
        tracing::info!(
            "listen_auto: Config::tls is set, and verbs traffic cannot be encrypted; serving shm and tcp only"
        );
        return;
    }
    let host = host_port.rsplit_once(':').map_or(host_port, |(h, _)| h);
    let Some(bootstrap) = port.checked_add(1) else {
        return;
    };
    match crate::verbs::listen(&format!("{host}:{bootstrap}"), config).await {
        Ok(l) => sources.push(accept::Source::Verbs(l)),
        Err(e) => {
            tracing::warn!(%e, "listen_auto: RDMA device present but the verbs listener failed; serving shm and tcp only")
        }
    }
}

#[cfg(not(feature = "verbs"))]
async fn listen_auto_verbs(_: &str, _: u16, _: &Config, _: &mut Vec<accept::Source>) {}

/// Connects to `uri` (`shm:///path.sock`, `tcp://host:port`, `verbs://host:port`, or
/// `ibex://host:port`: [`connect_auto`]).
pub async fn connect(uri: &str, config: Config) -> Result<Connection> {
    config.validate()?;
    let link: Box<dyn Link> = match Addr::parse(uri)? {
        Addr::Auto(a) => return Box::pin(connect_auto(&a, config)).await,
        Addr::Shm(p) => Box::new(crate::shm::connect(&p, &config).await?),
        Addr::Tcp(a) => Box::new(crate::tcp::connect(&a, &config).await?),
        Addr::Verbs(_) if config.tls.is_some() => return Err(crate::tls::refuse_on_verbs(uri)),
        #[cfg(feature = "verbs")]
        Addr::Verbs(a) => Box::new(crate::verbs::connect(&a, &config).await?),
        #[cfg(not(feature = "verbs"))]
        Addr::Verbs(_) => return Err(verbs_missing(uri)),
    };
    Connection::establish(link, &config).await
}

/// Connects to an auto listener at `host:port` over the best provider: shm when the host is
/// this machine and its shm socket exists; verbs (bootstrap on port + 1) when this host has
/// an RDMA device and the peer answers there; tcp otherwise. [`Config::auto_transport`]
/// (`IBEX_TRANSPORT=shm|tcp|verbs`) forces one. The choice is logged.
pub async fn connect_auto(host_port: &str, config: Config) -> Result<Connection> {
    let uri = choose_auto(host_port, &config)?;
    if uri.starts_with("verbs://") && config.auto_transport.is_none() {
        match connect(&uri, config.clone()).await {
            Ok(c) => {
                tracing::info!(%uri, "connect_auto picked verbs");
                return Ok(c);
            }
            Err(e) => {
                tracing::info!(%e, "connect_auto: no verbs listener at the peer; falling back to tcp")
            }
        }
        let tcp = format!("tcp://{host_port}");
        tracing::info!(uri = %tcp, "connect_auto picked a transport");
        return connect(&tcp, config).await;
    }
    tracing::info!(%uri, "connect_auto picked a transport");
    connect(&uri, config).await
}

/// The URI [`connect_auto`] would try first for `host:port` with `config`.
pub fn choose_auto(host_port: &str, config: &Config) -> Result<String> {
    let bad = |why: &str| Error::Address {
        addr: host_port.into(),
        why: why.into(),
    };
    let (host, port) = host_port
        .rsplit_once(':')
        .ok_or_else(|| bad("expected host:port"))?;
    let port: u16 = port.parse().map_err(|_| bad("port is not a number"))?;
    let shm = auto_shm_path(&config.shm_dir, port);
    let verbs = || format!("verbs://{host}:{}", port.saturating_add(1));
    match config.auto_transport.as_deref().filter(|s| !s.is_empty()) {
        Some("shm") => return Ok(format!("shm://{}", shm.display())),
        Some("tcp") => return Ok(format!("tcp://{host_port}")),
        Some("verbs") => return Ok(verbs()),
        Some(other) => {
            return Err(bad(&format!(
                "IBEX_TRANSPORT={other:?}: expected shm, tcp or verbs"
            )));
        }
        None => {}
    }
    if is_local_host(host) && shm.exists() {
        return Ok(format!("shm://{}", shm.display()));
    }
    // Verbs traffic cannot be encrypted: with TLS set, only a forced choice goes there
    // (and is refused with the reason).
    if config.tls.is_none() && verbs_device_present() {
        return Ok(verbs());
    }
    Ok(format!("tcp://{host_port}"))
}

fn verbs_device_present() -> bool {
    #[cfg(feature = "verbs")]
    {
        crate::verbs::device_available()
    }
    #[cfg(not(feature = "verbs"))]
    {
        false
    }
}

#[cfg(not(feature = "verbs"))]
fn verbs_missing(uri: &str) -> Error {
    Error::Address {
        addr: uri.into(),
        why: "this build has no verbs provider: rebuild with `--features verbs` (needs rdma-core at run time)".into(),
    }
}

/// Runs `f` on tokio's blocking pool: registration pins pages and can take long (seconds
/// for large buffers under emulation), so it never runs on a runtime thread.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::io("registering memory", std::io::Error::other(e.to_string())))?
}

/// Returns to the runtime once, waking itself: a cooperative spin's step. Not
/// `tokio::task::yield_now`, which defers the wake-up until the runtime has polled its I/O
/// driver (an `epoll_wait` per step).
async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if std::mem::replace(&mut yielded, true) {
            Poll::Ready(())
        } else {
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

/// Runs blocking work synchronously without holding up the runtime: on a multi-thread
/// runtime the worker hands its other tasks to the rest first (`block_in_place`); a
/// current-thread runtime has no other worker to hand them to, so it runs in place.
fn outside_runtime<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// A zero buffer of `len` bytes shared by every connection's threshold probe.
fn probe_buffer(len: usize) -> Bytes {
    static BUFS: std::sync::Mutex<Vec<Bytes>> = std::sync::Mutex::new(Vec::new());
    let mut all = BUFS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(b) = all.iter().find(|b| b.len() == len) {
        return b.clone();
    }
    let b = Bytes::from(vec![0u8; len]);
    // A handful of lengths at most (one per configuration in use).
    if all.len() < 8 {
        all.push(b.clone());
    }
    b
}

#[cfg(all(test, not(ibex_loom)))]
mod tests {
    use super::*;

    /// Two-part messages sent from many tasks at once, between single messages from
    /// others, arrive whole, as the parts they were sent in; one the peer refuses is
    /// refused before anything is queued, and so is a head longer than the head room.
    async fn parts_arrive_whole(provider: &str) {
        let at = match provider {
            "shm" => unit_shm_uri("parts"),
            _ => "tcp://127.0.0.1:0".into(),
        };
        let cfg = Config {
            max_message_size: 1 << 20,
            ..Config::default()
        };
        let l = listen(&at, cfg.clone()).await.unwrap();
        let at = l.local_uri();
        let (b, a) = tokio::join!(l.accept(), connect(&at, cfg));
        let (a, b) = (a.unwrap(), b.unwrap());
        let tasks = 8u8;
        let per_task = 40u32;
        let mut jobs = Vec::new();
        for t in 0..tasks {
            let a = a.clone();
            jobs.push(tokio::spawn(async move {
                for i in 0..per_task {
                    let head = Bytes::from(vec![b'H', t, i as u8]);
                    if t == 0 {
                        // Single messages in between.
                        a.send(Bytes::from(vec![b'S', t, i as u8])).await.unwrap();
                        continue;
                    }
                    // Small and large bodies (both by rendezvous); every 10th is over the
                    // peer's limit.
                    let len = match i % 10 {
                        9 => 2 << 20,
                        j if j % 2 == 0 => 100,
                        _ => 200 << 10,
                    };
                    let body = Bytes::from(vec![t; len]);
                    let r = a.send_parts(head, body).await;
                    assert_eq!(r.is_err(), len > 1 << 20, "{r:?}");
                }
            }));
        }
        let sent_parts = (tasks as usize - 1) * per_task as usize * 9 / 10;
        let total = per_task as usize + sent_parts;
        let mut parts = 0;
        for _ in 0..total {
            match b.recv_parts().await.unwrap() {
                (m, None) => assert_eq!(m[0], b'S', "a single message comes alone"),
                (head, Some(body)) => {
                    assert_eq!(head[0], b'H');
                    assert!(
                        body.len() == 100 || body.len() == 200 << 10,
                        "{}",
                        body.len()
                    );
                    assert!(
                        body.iter().all(|&x| x == head[1]),
                        "a body comes with its head"
                    );
                    parts += 1;
                }
            }
        }
        for j in jobs {
            j.await.unwrap();
        }
        assert_eq!(parts, sent_parts);
        // Too long a head: refused here, nothing sent.
        let room = a.head_room();
        assert!(room > 1024 && room < cfg_slot(), "{room}");
        let e = a
            .send_parts(Bytes::from(vec![1; room + 1]), Bytes::from_static(b"x"))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::TooLarge { .. }), "{e}");
        // `recv` joins the parts; an empty body is a message all the same.
        a.send_parts(Bytes::from(vec![2; room]), Bytes::from_static(b"cd"))
            .await
            .unwrap();
        a.send_parts(Bytes::from_static(b"ab"), Bytes::new())
            .await
            .unwrap();
        let joined = b.recv().await.unwrap();
        assert_eq!(joined.len(), room + 2);
        assert!(joined[..room].iter().all(|&x| x == 2) && &joined[room..] == b"cd");
        assert_eq!(
            b.recv_parts().await.unwrap(),
            (Bytes::from_static(b"ab"), Some(Bytes::new()))
        );
    }

    /// An shm address of this test process's own, so concurrent test binaries never share
    /// a socket file.
    fn unit_shm_uri(name: &str) -> String {
        format!(
            "shm://{}",
            std::env::temp_dir()
                .join(format!("ibex-unit-{}-{name}.sock", std::process::id()))
                .display()
        )
    }

    fn cfg_slot() -> usize {
        Config::default().slot_size
    }

    /// A listener with serve threads sets each accepted connection up on a thread of Ibex's
    /// own (its home, where all its tasks run), round robin over them, and the connection
    /// works as any other; the connecting side stays on its caller's runtime.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serve_threads_home_accepted_connections() {
        let at = unit_shm_uri("homes");
        let cfg = Config {
            serve_threads: 2,
            ..Config::default()
        };
        let l = listen(&at, cfg).await.unwrap();
        let at = l.local_uri();
        let mut homes = Vec::new();
        for _ in 0..2 {
            let (b, a) = tokio::join!(l.accept(), connect(&at, Config::default()));
            let (a, b) = (a.unwrap(), b.unwrap());
            assert!(
                b.home().is_some(),
                "an accepted connection lives on a serve thread"
            );
            homes.push(
                b.spawn(async { std::thread::current().name().unwrap_or("").to_owned() })
                    .await
                    .unwrap(),
            );
            assert!(
                a.home().is_none(),
                "the connecting side stays on its caller's runtime"
            );
            a.send(Bytes::from_static(b"ping")).await.unwrap();
            assert_eq!(&b.recv().await.unwrap()[..], b"ping");
            b.send(Bytes::from_static(b"pong")).await.unwrap();
            assert_eq!(&a.recv().await.unwrap()[..], b"pong");
        }
        assert!(
            homes.iter().all(|h| h.starts_with("ibex-serve-")),
            "{homes:?}"
        );
        assert_ne!(homes[0], homes[1], "round robin over the serve threads");
        // A connection made on a serve thread by other code (a handler that calls another
        // server) is not an accepted one: it does not take the serve thread as its home.
        let to = at.clone();
        let (b, a) = tokio::join!(
            l.accept(),
            home::next(2)
                .unwrap()
                .spawn(async move { connect(&to, Config::default()).await })
        );
        let (a, _b) = (a.unwrap().unwrap(), b.unwrap());
        assert!(a.home().is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parts_arrive_whole_over_shm() {
        parts_arrive_whole("shm").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parts_arrive_whole_over_tcp() {
        parts_arrive_whole("tcp").await;
    }

    /// `recv_into` takes a two-part message whole: posted before the message comes, the body
    /// lands in the caller's buffer and the head is moved in front of it; a buffer that holds
    /// the body but not the head is too small, and the message stays, in its parts.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn recv_into_takes_a_two_part_message_whole() {
        let at = unit_shm_uri("into");
        let l = listen(&at, Config::default()).await.unwrap();
        let at = l.local_uri();
        let (b, a) = tokio::join!(l.accept(), connect(&at, Config::default()));
        let (a, b) = (a.unwrap(), b.unwrap());
        let head = Bytes::from_static(b"head");
        let body = Bytes::from((0..300u32 << 10).map(|i| i as u8).collect::<Vec<u8>>());
        let whole = [&head[..], &body[..]].concat();

        // Posted first: one poll of the receive, with nothing delivered yet, posts its
        // buffer before the message is sent (a fixed wait for a spawned receiver could run
        // out first on a loaded machine). Unconstrained: the task budget cannot cut that
        // poll short.
        let mut rx = Box::pin(tokio::task::unconstrained(
            b.recv_into(vec![0u8; 400 << 10]),
        ));
        let first = std::future::poll_fn(|cx| Poll::Ready(rx.as_mut().poll(cx))).await;
        assert!(first.is_pending());
        a.send_parts(head.clone(), body.clone()).await.unwrap();
        let (got, len) = rx.await.unwrap();
        assert_eq!(len, whole.len());
        assert!(got[..len] == whole[..], "head, then body");
        assert_eq!(
            b.stats().recv_into_direct,
            1,
            "the body landed in the posted buffer"
        );

        a.send_parts(head.clone(), body.clone()).await.unwrap();
        let e = b.recv_into(vec![0u8; body.len()]).await.unwrap_err();
        assert!(
            matches!(e, Error::BufferTooSmall { len, .. } if len == whole.len() as u64),
            "{e}"
        );
        assert_eq!(b.recv_parts().await.unwrap(), (head, Some(body)));
    }
}
