//! The server: accepts Ibex connections and feeds their calls to tonic services.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::Status;
use tonic::server::NamedService;
use tonic::service::Routes;
use tower::Service;

use super::body::{Held, IbexBody, Inbound, InboxTx, IncomingBody, inbox};
use super::calls::{Admit, CallTable, Entry, Slot, Verdict};
use super::demux::{Demux, Got, KeptHead};
use super::direct::{
    DirectProbe, DirectRoute, ReadyAnswer, Started, WholeRequest, direct_message, into_http,
    one_plain_message,
};
use super::pump::{self, Now, Side, pump, trailers_only};
use super::router::{Direct, Handler, Router};
use super::wire::{Head, Limits, Packet, Trailers};
use super::{CallShared, Encoded, Flag, Mux, parse_timeout};
use crate::config::Config;
use crate::conn::{ConnStats, Connection, Listener};
use crate::error::{Error, Result};
use crate::link::RecvBuf;
use crate::pool::Pool;

/// The gRPC server over Ibex. Start with [`Server::builder`].
#[derive(Debug)]
pub struct Server;

impl Server {
    /// A builder to add services to and then serve.
    pub fn builder() -> Builder {
        Builder::default()
    }
}

/// Collects services, then serves them: `Server::builder().add_service(svc).serve(uri)`.
#[derive(Debug, Default)]
pub struct Builder {
    /// Every service, for stock HTTP/2 (`serve_any`) and as the Ibex router's fallback.
    routes: Option<Routes>,
    /// The services added one by one, which Ibex connections call without tonic's router.
    router: Router,
    config: Option<Config>,
    /// Listener settings from tonic-named methods, applied over `config`.
    tcp_keepalive: Option<Option<std::time::Duration>>,
    connection_window: Option<u32>,
    keepalive_interval: Option<std::time::Duration>,
    keepalive_timeout: Option<std::time::Duration>,
    stats: ServerStats,
    limits: ServeLimits,
}

/// What one client connection may ask of the server.
#[derive(Debug, Clone, Copy)]
struct ServeLimits {
    wire: Limits,
    max_concurrent_calls: usize,
    /// Keep-alive pings on every accepted connection: interval and answer timeout.
    keepalive: Option<(std::time::Duration, std::time::Duration)>,
    /// Body bytes one connection may hold for handlers that have not taken them.
    max_held: usize,
}

/// The default of [`ServeLimits::max_held`]: as the transport's receive budget.
const DEFAULT_MAX_HELD: usize = 256 << 20;

/// The default of [`Builder::max_concurrent_calls`].
pub const DEFAULT_MAX_CONCURRENT_CALLS: usize = 4096;

impl Default for ServeLimits {
    fn default() -> ServeLimits {
        ServeLimits {
            wire: Limits::default(),
            max_concurrent_calls: DEFAULT_MAX_CONCURRENT_CALLS,
            keepalive: None,
            max_held: DEFAULT_MAX_HELD,
        }
    }
}

/// The transport counters of a server's connections, for metrics: take it with
/// [`Builder::stats`] before serving, read it at any time while (and after) the server runs.
#[derive(Debug, Clone, Default)]
pub struct ServerStats {
    inner: Arc<Mutex<StatsInner>>,
}

#[derive(Debug, Default)]
struct StatsInner {
    next: u64,
    live: HashMap<u64, Connection>,
    /// Counters of connections that have ended, so totals never go backwards.
    closed: ConnStats,
    closed_count: u64,
    direct_routes: u64,
    repeated_heads: u64,
}

impl ServerStats {
    fn lock(&self) -> std::sync::MutexGuard<'_, StatsInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, conn: &Connection) -> u64 {
        let mut st = self.lock();
        st.next += 1;
        let id = st.next;
        st.live.insert(id, conn.clone());
        id
    }

    fn remove(&self, id: u64) {
        let mut st = self.lock();
        if let Some(c) = st.live.remove(&id) {
            let s = c.stats();
            st.closed.accumulate(&s);
            st.closed_count += 1;
        }
    }

    /// Each open connection's peer and counters.
    pub fn connections(&self) -> Vec<(String, ConnStats)> {
        let live: Vec<Connection> = self.lock().live.values().cloned().collect();
        live.iter().map(|c| (c.peer(), c.stats())).collect()
    }

    /// How many times a connection learned a direct route: a method of a service generated
    /// with ibex-codegen, added as it was generated (not behind an interceptor or a layer),
    /// whose calls then skip the `http::Request`, the router and tonic's per-call
    /// machinery. Each connection learns each such method once, on its first whole
    /// request. Zero while calls are made means no service here takes that path: check
    /// that `build.rs` uses `ibex_codegen::direct`.
    pub fn direct_routes(&self) -> u64 {
        self.lock().direct_routes
    }

    fn learned_direct_route(&self) {
        self.lock().direct_routes += 1;
    }

    /// How many requests on connections that have ended repeated, byte for byte, a head
    /// the connection keeps, and so were not decoded again: whole unary calls (one
    /// message each way) whose path and metadata stay the same from call to call (up to
    /// four such heads taking turns per connection), on a direct route, skip the head's
    /// decoding, the route lookup and the look at their headers. Far fewer than such
    /// calls means their metadata changes on every call (a request id, a trace context):
    /// each of those heads is decoded in full, which costs a few hundred nanoseconds more
    /// a call.
    pub fn repeated_heads(&self) -> u64 {
        self.lock().repeated_heads
    }

    /// Counters summed over every connection the server has had, open or ended, and how
    /// many connections that is.
    pub fn totals(&self) -> (ConnStats, u64) {
        let (mut total, live, closed) = {
            let st = self.lock();
            (
                st.closed.clone(),
                st.live.values().cloned().collect::<Vec<_>>(),
                st.closed_count,
            )
        };
        for c in &live {
            total.accumulate(&c.stats());
        }
        (total, closed + live.len() as u64)
    }
}

/// tonic's default keep-alive timeout.
const DEFAULT_KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

impl Builder {
    /// The keep-alive interval and answer timeout, when pings are on.
    fn keepalive(&self) -> Option<(std::time::Duration, std::time::Duration)> {
        self.keepalive_interval.map(|i| {
            (
                i,
                self.keepalive_timeout.unwrap_or(DEFAULT_KEEPALIVE_TIMEOUT),
            )
        })
    }

    /// A handle on the counters of the connections this server will accept.
    pub fn stats(&self) -> ServerStats {
        self.stats.clone()
    }

    /// The transport configuration for accepted connections (default: [`Config::from_env`]).
    pub fn config(mut self, config: Config) -> Self {
        self.config = Some(config);
        self
    }

    /// Calls one client connection may have in flight (default 4096). A call past it is
    /// answered `ResourceExhausted` at once, naming this setting.
    pub fn max_concurrent_calls(mut self, n: usize) -> Self {
        self.limits.max_concurrent_calls = n.max(1);
        self
    }

    /// tonic's name for [`Builder::max_concurrent_calls`] (HTTP/2's streams are calls).
    pub fn max_concurrent_streams(self, max: impl Into<Option<u32>>) -> Self {
        match max.into() {
            Some(n) => self.max_concurrent_calls(usize::try_from(n).unwrap_or(usize::MAX)),
            None => self,
        }
    }

    /// Pings each client connection after this long without hearing from it, and closes
    /// it when no answer comes within [`Builder::http2_keepalive_timeout`] (20 s unless
    /// set), so a client that hangs or vanished stops holding its calls (tonic's setting;
    /// see [`Config::keepalive`]). Applies to every connection this server accepts.
    pub fn http2_keepalive_interval(mut self, interval: Option<std::time::Duration>) -> Self {
        self.keepalive_interval = interval.filter(|i| !i.is_zero());
        self
    }

    /// How long a keep-alive ping may go unanswered (default 20 s, as tonic's).
    pub fn http2_keepalive_timeout(mut self, timeout: Option<std::time::Duration>) -> Self {
        self.keepalive_timeout = timeout.filter(|t| !t.is_zero());
        self
    }

    /// TCP keep-alive on accepted tcp connections ([`Config::tcp_keepalive`]), as tonic's.
    /// Part of the listener's configuration: it applies where this builder makes the
    /// listener (`serve*` with a URI), not to one passed to `serve_with_listener`.
    pub fn tcp_keepalive(mut self, idle: Option<std::time::Duration>) -> Self {
        self.tcp_keepalive = Some(idle);
        self
    }

    /// What tonic calls the connection window: the request body bytes one connection may
    /// hold for handlers that have not taken them (default 256 MiB; past it the server
    /// reads nothing more from that client until they do), and the transport's receive
    /// memory for messages in flight ([`Config::rndv_recv_budget`], part of the listener's
    /// configuration, as [`Builder::tcp_keepalive`] is).
    pub fn initial_connection_window_size(mut self, bytes: impl Into<Option<u32>>) -> Self {
        self.connection_window = bytes.into().filter(|&b| b > 0);
        if let Some(b) = self.connection_window {
            self.limits.max_held = b as usize;
        }
        self
    }

    /// Accepted for tonic compatibility; a call's window is fixed at 8 MiB here (bodies
    /// travel in pieces of at most 8 MiB, whatever the message size; see docs/grpc.md).
    pub fn initial_stream_window_size(self, bytes: impl Into<Option<u32>>) -> Self {
        let _ = bytes.into();
        self
    }

    /// Bytes of one request header list, counted as HTTP/2 counts them (name + value + 32
    /// per entry; default 16 KiB, as hyper's). A client that sends more loses its
    /// connection, with the limit named in the server's log.
    pub fn max_header_list_size(mut self, bytes: usize) -> Self {
        self.limits.wire.max_header_list_size = bytes;
        self
    }

    /// Adds a generated tonic service (`GreeterServer::new(..)`, ...), or anything tonic's
    /// router takes: `EchoServer::with_interceptor(svc, check_auth)`, a service wrapped in
    /// tower layers.
    pub fn add_service<S>(mut self, svc: S) -> Self
    where
        S: Service<http::Request<tonic::body::Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse + 'static,
        S::Future: Send + 'static,
    {
        self.router.add_service(svc.clone());
        self.routes = Some(self.routes.take().unwrap_or_default().add_service(svc));
        self
    }

    /// Adds every service of `routes`.
    pub fn add_routes(mut self, routes: Routes) -> Self {
        self.routes = Some(match self.routes.take() {
            None => routes,
            // Both carry tonic's `Unimplemented` fallback; the merged router keeps one.
            Some(mine) => Routes::from(
                mine.into_axum_router()
                    .merge(routes.into_axum_router().reset_fallback()),
            ),
        });
        self
    }

    /// Listens on `uri` (`shm:///path.sock`, `tcp://host:port`) and serves until an error.
    pub async fn serve(self, uri: &str) -> Result<()> {
        self.serve_with_shutdown(uri, std::future::pending()).await
    }

    /// Like [`Builder::serve`], until `signal` completes; then stops accepting, tells
    /// clients to make no new calls, lets the calls in flight finish, and returns.
    pub async fn serve_with_shutdown<F: Future<Output = ()>>(
        self,
        uri: &str,
        signal: F,
    ) -> Result<()> {
        let mut config = match &self.config {
            Some(c) => c.clone(),
            None => Config::from_env()?,
        };
        if let Some(k) = self.tcp_keepalive {
            config.tcp_keepalive = k;
        }
        if let Some(w) = self.connection_window {
            config.rndv_recv_budget = w as usize;
        }
        let listener = crate::conn::listen(uri, config).await?;
        self.serve_with_listener(listener, signal).await
    }

    /// Serves on any address: an Ibex one (`shm://`, `tcp://`, `verbs://`) like
    /// [`Builder::serve_with_shutdown`], or `http://host:port` with stock tonic's HTTP/2
    /// server and the same services, so one program serves both kinds of deployment.
    /// Over HTTP/2 requests carry no [`PeerHandle`] and [`Builder::stats`] stays empty.
    pub async fn serve_any<F: Future<Output = ()>>(self, uri: &str, signal: F) -> Result<()> {
        let Some(host_port) = uri.strip_prefix("http://") else {
            return self.serve_with_shutdown(uri, signal).await;
        };
        let bad = |why: String| Error::Address {
            addr: uri.into(),
            why,
        };
        let host_port = host_port.trim_end_matches('/');
        let addr = tokio::net::lookup_host(host_port)
            .await
            .map_err(|e| bad(format!("cannot resolve {host_port:?}: {e}")))?
            .next()
            .ok_or_else(|| bad(format!("{host_port:?} resolves to no address")))?;
        let keepalive = self.keepalive();
        let routes = self.routes.unwrap_or_default();
        tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .tcp_keepalive(self.tcp_keepalive.flatten())
            .http2_keepalive_interval(keepalive.map(|k| k.0))
            .http2_keepalive_timeout(keepalive.map(|k| k.1))
            .initial_connection_window_size(self.connection_window)
            .max_concurrent_streams(u32::try_from(self.limits.max_concurrent_calls).ok())
            .add_routes(routes)
            .serve_with_shutdown(addr, signal)
            .await
            .map_err(|e| Error::Io {
                context: format!("serving gRPC over HTTP/2 on {addr}"),
                source: std::sync::Arc::new(std::io::Error::other(e.to_string())),
            })
    }

    /// Serves on a listener made beforehand (e.g. to learn its `local_uri` first).
    pub async fn serve_with_listener<F: Future<Output = ()>>(
        self,
        listener: Listener,
        signal: F,
    ) -> Result<()> {
        let mut limits = self.limits;
        limits.keepalive = self.keepalive();
        let mut router = self.router;
        router.set_fallback(self.routes.unwrap_or_default());
        let shutdown = Arc::new(Flag::default());
        // `accept` is cancel-safe (each peer's set-up runs in the listener's own tasks, under
        // a deadline), so it can sit in the select with the rest.
        let mut conns = JoinSet::new();
        let mut stopped = None;
        tokio::pin!(signal);
        loop {
            tokio::select! {
                _ = &mut signal => break,
                c = listener.accept() => match c {
                    Ok(conn) => {
                        let stats = self.stats.clone();
                        let id = stats.add(&conn);
                        let (router, shutdown) = (router.clone(), shutdown.clone());
                        let home = conn.home().cloned();
                        let served = async move {
                            serve_conn(conn, router, shutdown, limits, stats.clone()).await;
                            stats.remove(id);
                        };
                        match home {
                            // On its serve thread (`Config::serve_threads`), where its driver
                            // runs too, with this runtime entered: what a handler spawns runs
                            // here, as over stock tonic, and not on the serve thread.
                            Some(home) => {
                                let here = tokio::runtime::Handle::current();
                                conns.spawn_on(entered(here, served), &home)
                            }
                            None => conns.spawn(served),
                        };
                    }
                    // The listener itself stopped: drain what is running, then say why.
                    Err(e) => {
                        stopped = Some(e);
                        break;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        // Stop accepting first, then drain. Closed, not just dropped: once serving returns,
        // the address is free to bind again.
        listener.close().await;
        shutdown.set();
        while conns.join_next().await.is_some() {}
        match stopped {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// What a handler can do with the client's connection beyond the call itself: pull buffers
/// the client exposed with [`Channel::expose`](super::Channel::expose). Found in every
/// request's extensions: `req.extensions().get::<PeerHandle>()`.
#[derive(Clone, Debug)]
pub struct PeerHandle {
    conn: Connection,
    id: u64,
}

/// Source of [`PeerHandle::id`]: process-wide, so ids are never reused.
static NEXT_PEER_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl PeerHandle {
    /// True when reads take no CPU on the client (shm CMA, RDMA READ). When false,
    /// [`PeerHandle::read_remote`] still works but the client's transport serves it (tcp),
    /// and sending the data in the message body is usually as fast.
    pub fn one_sided(&self) -> bool {
        self.conn.one_sided()
    }

    /// The smallest buffer worth answering by descriptor on this connection
    /// ([`Connection::remote_min`](crate::Connection::remote_min)); `None` when the client's
    /// reads would not be one-sided.
    pub fn remote_min(&self) -> Option<usize> {
        self.conn.remote_min()
    }

    /// Names the connection: the same for every request on it, never reused by another
    /// connection of this process. Handlers key per-connection state on it (what a client
    /// may release, how much it holds) without keeping the connection itself alive.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Reads the client buffer named by `descriptor` into `dst` (exactly as long as the
    /// bytes wanted).
    pub async fn read_remote(&self, descriptor: Bytes, dst: RecvBuf) -> Result<RecvBuf> {
        self.conn.read_remote(descriptor, dst).await
    }

    /// Exposes `buf` for one-sided reads by the client until the returned
    /// [`RemoteBuf`](super::RemoteBuf) is dropped: a reply can carry its descriptor instead
    /// of the bytes (the client pulls with `Connection::read_remote`).
    pub async fn expose(&self, buf: Bytes) -> Result<super::RemoteBuf> {
        self.conn.expose(buf).await
    }

    /// The registered pool, for destination buffers that need no further copy.
    pub fn pool(&self) -> Option<Arc<Pool>> {
        self.conn.pool()
    }

    /// True when exposing memory costs a registration unless it comes from
    /// [`PeerHandle::alloc`] (verbs); see [`Connection::exposing_registers`].
    pub fn exposing_registers(&self) -> bool {
        self.conn.exposing_registers()
    }

    /// A buffer that [`PeerHandle::expose`] shares with no copy and no registration
    /// ([`Connection::alloc`]): fill it, freeze it, expose it. May block the first time
    /// registered memory must grow (verbs), so call it where blocking is fine.
    pub fn alloc(&self, len: usize) -> Result<crate::PoolBufMut> {
        self.conn.alloc(len)
    }

    /// Who the client is, for logs.
    pub fn peer(&self) -> String {
        self.conn.peer()
    }
}

/// Who a request came from, in every request's extensions (beside tonic's own
/// `TcpConnectInfo` where the peer has a socket address, so `Request::remote_addr()`
/// answers as over stock tonic).
#[derive(Clone, Debug)]
pub struct ConnectInfo {
    /// `"shm"`, `"tcp"` or `"verbs"`.
    pub provider: &'static str,
    /// The peer as the provider names it (an address, or `pid N uid M` on shm). Shared,
    /// since every request carries a copy of this.
    pub peer: Arc<str>,
    /// The peer's socket address (tcp; verbs: its bootstrap connection).
    pub remote_addr: Option<std::net::SocketAddr>,
    /// The peer's process id (shm, from the kernel's credentials of its socket).
    pub peer_pid: Option<u32>,
    /// The peer's user id (shm, from the same credentials).
    pub peer_uid: Option<u32>,
}

impl ConnectInfo {
    fn of(conn: &Connection) -> ConnectInfo {
        let peer = conn.peer();
        ConnectInfo {
            provider: conn.provider(),
            remote_addr: peer.parse().ok(),
            peer_pid: cred(&peer, "pid"),
            peer_uid: cred(&peer, "uid"),
            peer: peer.into(),
        }
    }
}

/// A number the shm provider names in its peer string (`pid 1234 uid 1000`).
fn cred(peer: &str, what: &str) -> Option<u32> {
    let mut words = peer.split_whitespace();
    while let Some(w) = words.next() {
        if w == what {
            return words.next()?.parse().ok();
        }
    }
    None
}

/// The `date` header of responses, formatted at most once a second (as hyper does).
fn date_header() -> http::HeaderValue {
    thread_local! {
        static CACHED: std::cell::RefCell<(u64, Option<http::HeaderValue>)> =
            const { std::cell::RefCell::new((0, None)) };
    }
    let sec = unix_seconds();
    CACHED.with(|c| {
        let mut c = c.borrow_mut();
        if c.0 != sec || c.1.is_none() {
            let now = std::time::UNIX_EPOCH + std::time::Duration::from_secs(sec);
            let v = http::HeaderValue::from_str(&httpdate::fmt_http_date(now))
                .unwrap_or_else(|_| http::HeaderValue::from_static(""));
            *c = (sec, Some(v));
        }
        c.1.clone()
            .unwrap_or_else(|| http::HeaderValue::from_static(""))
    })
}

/// Whole seconds since the Unix epoch, for the `date` header. On Linux from the coarse
/// clock: it reads the kernel's last tick (a few ms old at most) without the timestamp
/// counter, which a VM makes cost about 25 ns, as much as taking a small message from
/// shared memory. A header of whole seconds needs no finer clock.
fn unix_seconds() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec for the duration of the call, and
        // CLOCK_REALTIME_COARSE takes no other argument.
        if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) } == 0 {
            return u64::try_from(ts.tv_sec).unwrap_or(0);
        }
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `fut`, polled with `rt` entered: `tokio::spawn` and timers in it use `rt`, wherever it runs.
async fn entered<F: Future>(rt: tokio::runtime::Handle, fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx| {
        let _in = rt.enter();
        fut.as_mut().poll(cx)
    })
    .await
}

/// One accepted connection's calls.
struct ConnState {
    mux: Arc<Mux>,
    calls: Mutex<CallTable<ServerCall>>,
}

struct ServerCall {
    /// `None` when the request came whole in its first packet.
    body: Option<InboxTx>,
    shared: Arc<CallShared>,
}

impl Slot for ServerCall {
    fn call(&self) -> &CallShared {
        &self.shared
    }
}

impl ConnState {
    fn lock(&self) -> std::sync::MutexGuard<'_, CallTable<ServerCall>> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Starts a call's future ([`run_call`]); a pointer to it names the future's type, so the
/// running calls are stored unboxed.
type StartCall<F> = fn(Arc<ConnState>, u32, Arc<CallShared>, Start, Option<Instant>) -> F;

/// What one connection's task needs besides the connection.
struct ConnCtx<F> {
    st: Arc<ConnState>,
    /// What every request's extensions hold (see [`ConnCtx::extensions`]).
    extensions: http::Extensions,
    router: Router,
    stats: ServerStats,
    /// Body bytes held for this connection's handlers (see [`Held`]).
    held: Arc<Held>,
    draining: bool,
    /// The calls in flight. They run on this task, the one that reads the connection: a
    /// handler that is ready at once answers in the poll that brought its request, with no
    /// task hop, and its reply goes straight onto the link.
    running: FuturesUnordered<F>,
    start: StartCall<F>,
    /// By the slot of each head the connection's demultiplexer keeps for repeats: that
    /// head's number, its direct route and its request's timeout. A repeated request needs
    /// no lookup and no look at its headers.
    repeat_routes: [Option<(u64, DirectRoute, Option<std::time::Duration>)>; Demux::MAX_KEPT],
    /// Set while a repeat of this kept head (slot, number) takes the general way.
    learning: Option<(KeptHead, u64)>,
    /// Requests that came as repeats (see [`ServerStats::repeated_heads`]), counted here
    /// and added to the server's count when the connection ends.
    repeats: u64,
}

/// The extensions every request on `conn` carries: the peer, as `PeerHandle` and
/// [`ConnectInfo`], and as tonic's `TcpConnectInfo` where it has a socket address.
fn request_extensions(conn: &Connection) -> http::Extensions {
    let info = ConnectInfo::of(conn);
    let mut extensions = http::Extensions::new();
    if let Some(a) = info.remote_addr {
        extensions.insert(tonic::transport::server::TcpConnectInfo {
            local_addr: None,
            remote_addr: Some(a),
        });
    }
    extensions.insert(info);
    extensions.insert(PeerHandle {
        conn: conn.clone(),
        id: NEXT_PEER_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
    });
    extensions
}

async fn serve_conn(
    conn: Connection,
    router: Router,
    shutdown: Arc<Flag>,
    limits: ServeLimits,
    stats: ServerStats,
) {
    if let Some((interval, timeout)) = limits.keepalive
        && let Err(e) = conn.set_keepalive(Some(interval), timeout)
    {
        tracing::warn!(%e, "gRPC server: keep-alive not applied");
    }
    let mut cx = ConnCtx {
        st: Arc::new(ConnState {
            mux: Arc::new(Mux::new(conn.clone(), Side::Server)),
            calls: Mutex::new(CallTable::new(Side::Server, limits.max_concurrent_calls)),
        }),
        extensions: request_extensions(&conn),
        router,
        stats,
        held: Held::new(limits.max_held),
        draining: false,
        running: FuturesUnordered::new(),
        start: run_call,
        repeat_routes: Default::default(),
        learning: None,
        repeats: 0,
    };
    let mut demux = Demux::new(true, limits.wire);
    let held = cx.held.clone();
    let peer = conn.peer();
    // Why the connection is closed from this side, for the peer's error.
    let mut broken = String::new();
    // One wait for the whole connection: a fresh one per turn of the loop registered and
    // unregistered with the flag's `Notify` (two locks) on every message. Polled once here,
    // which leaves this task's waker with the `Notify`, and after that only once the flag
    // is set (it is set before its waiters are woken): polling it on every message took
    // the `Notify`'s lock to compare wakers, about 200 instructions a call. The flag is
    // read inside the branch's future, not in its precondition: a precondition is read
    // once per `select!`, and a wake-up re-polls that same `select!`.
    let stop = shutdown.wait();
    tokio::pin!(stop);
    // `true` when the server was stopping already: `stop` is done and must not be polled.
    let stopped = std::future::poll_fn(|c| Poll::Ready(stop.as_mut().poll(c).is_ready())).await;
    loop {
        tokio::select! {
            biased;
            () = std::future::poll_fn(|c| {
                if stopped || (shutdown.is_set() && stop.as_mut().poll(c).is_ready()) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            }), if !cx.draining => {
                cx.draining = true;
                cx.st.lock().drain();
                let mut p = Packet::new(0);
                p.goaway = true;
                let _ = cx.st.mux.send(p, None).await;
                if cx.running.is_empty() {
                    break;
                }
            }
            Some(()) = cx.running.next(), if !cx.running.is_empty() => {
                if cx.draining && cx.running.is_empty() {
                    break;
                }
            }
            // Handlers have not taken what they hold: read nothing more until they do.
            () = held.below(), if held.over() => {}
            // A client that leaves while we hold its bodies ends its calls all the same.
            () = conn.closed(), if held.over() => {
                tracing::debug!("gRPC server: connection ended while paused");
                break;
            }
            msg = std::future::poll_fn(|c| conn.poll_recv_parts(c)), if !held.over() => {
                let msg = match msg {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::debug!(%e, "gRPC server: connection ended");
                        break;
                    }
                };
                let r = match demux.push(msg) {
                    Ok(Got::One(p, data)) => cx.dispatch(p, data),
                    Ok(Got::Repeat(id, frame, k)) => cx.dispatch_repeat(&demux, k, id, frame),
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    tracing::warn!(%e, %peer, "gRPC server: closing the connection");
                    broken = e.to_string();
                    break;
                }
            }
        }
    }
    // Whatever is still running has lost its client (or the connection broke the protocol).
    let gone = request_cut("the client's connection is gone");
    for c in cx.st.lock().close(gone.clone()) {
        if let Some(b) = &c.body {
            b.send(Inbound::Error(gone.clone()));
        }
    }
    while cx.running.next().await.is_some() {}
    cx.stats.lock().repeated_heads += cx.repeats;
    conn.close_with(&broken).await;
}

impl<F: Future<Output = ()>> ConnCtx<F> {
    /// A whole request whose head repeats kept head `k` of `demux`: straight to its
    /// direct route once the head's route is known; the general way (which learns it)
    /// otherwise.
    fn dispatch_repeat(&mut self, demux: &Demux, k: KeptHead, id: u32, frame: Bytes) -> Result<()> {
        self.repeats += 1;
        let Some((Head::Request { headers, .. }, number)) = demux.repeated(k) else {
            return Err(lost_repeat(id));
        };
        if let Some(Some((n, route, timeout))) = self.repeat_routes.get(k.0)
            && *n == number
            && let Some(msg) = one_plain_message(&frame, route.max_decoding)
        {
            let (route, timeout) = (route.clone(), *timeout);
            return self.dispatch_direct(id, &route, msg, headers.clone(), timeout);
        }
        let Some((p, data)) = demux.expand(k, id, frame) else {
            return Err(lost_repeat(id));
        };
        self.learning = Some((k, number));
        let r = self.dispatch(p, data);
        self.learning = None;
        r
    }

    /// A trailers-only answer to a call that never reaches a handler.
    fn refuse(&self, id: u32, status: Status) {
        self.st.mux.send_detached(trailers_only(id, status));
    }

    fn dispatch(&mut self, mut p: Packet, data: Option<Bytes>) -> Result<()> {
        let Some(Head::Request { path, headers, .. }) = p.head.take() else {
            return self.dispatch_other(p, data, None);
        };
        // A whole request for a direct route skips the `http::Request`, the router and
        // the service's boxed future; a path not seen yet probes for one. (A packet that
        // also carries a window grant or GOAWAY, which no client sends with a request,
        // takes the usual way, which accounts for them.)
        let mut probe = None;
        if p.end && !p.reset {
            match self.router.direct(&path) {
                Direct::Route(route) if !p.goaway && p.window.is_none() => {
                    if let Some((msg, timeout)) = data
                        .as_ref()
                        .and_then(|d| direct_message(&headers, d, route.max_decoding))
                    {
                        let route = route.clone();
                        if let Some((k, number)) = self.learning
                            && let Some(slot) = self.repeat_routes.get_mut(k.0)
                        {
                            *slot = Some((number, route.clone(), timeout));
                        }
                        return self.dispatch_direct(p.call, &route, msg, headers, timeout);
                    }
                }
                Direct::Probe(pr) => probe = Some(pr),
                Direct::Route(_) | Direct::None => {}
            }
        }
        self.dispatch_other(p, data, Some((path, headers, probe)))
    }

    /// Every packet but a whole request on a direct route: `head` is the request head it
    /// carried, with the probe for a path not seen yet.
    ///
    /// Kept out of line: its frame holds an `http::Request` and the call's future on their
    /// way to the heap, several KiB of stack that the direct path, which returns before
    /// it, would otherwise reserve and spread its own few lines over on every call.
    #[inline(never)]
    fn dispatch_other(
        &mut self,
        p: Packet,
        mut data: Option<Bytes>,
        head: Option<(
            http::uri::PathAndQuery,
            http::HeaderMap,
            Option<DirectProbe>,
        )>,
    ) -> Result<()> {
        let id = p.call;
        let data_len = data.as_ref().map(Bytes::len);
        let mut started = None;
        if let Some((path, headers, probe)) = head {
            // A request that came whole in this packet (a unary one) needs no inbox.
            let complete = p.end && !p.reset;
            let call = CallShared::new();
            let mut whole = None;
            let (tx, body) = if complete {
                let held = Some(self.held.clone());
                whole = data.clone().map(WholeRequest);
                (None, Some(IncomingBody::complete(data.take(), None, held)))
            } else {
                let (tx, rx) = inbox(Some(self.held.clone()));
                let body = IbexBody::new(rx, self.st.mux.clone(), id, call.clone(), || {
                    request_cut("the client's connection is gone")
                });
                (Some(tx), Some(IncomingBody::from(body)))
            };
            {
                let mut calls = self.st.lock();
                match calls.admit(id)? {
                    Admit::Open => calls.insert(
                        id,
                        ServerCall {
                            body: tx,
                            shared: call.clone(),
                        },
                    ),
                    Admit::Refuse(status) => {
                        drop(calls);
                        self.refuse(id, status);
                        return Ok(());
                    }
                }
            }
            let deadline = parse_timeout(&headers).map(|t| Instant::now() + t);
            let extensions = self.extensions();
            // The service is called here, on the connection's own clone of it, so its
            // synchronous part (an interceptor, a tower layer) runs on this task: a panic
            // there must fail only this call, as one in the handler's future does. A call
            // whose head came with its reset never reaches the service.
            // The path is kept only to record what a probe finds.
            let probed = probe.as_ref().map(|pr| (path.clone(), pr.clone()));
            let first = if p.reset {
                Start::Ended(false)
            } else {
                let mut req = http::Request::new(tonic::body::Body::new(body.unwrap_or_default()));
                *req.method_mut() = http::Method::POST;
                *req.uri_mut() = http::Uri::from(path);
                *req.version_mut() = http::Version::HTTP_2;
                *req.headers_mut() = headers;
                *req.extensions_mut() = extensions;
                // For a route generated with ibex-codegen: it decodes this frame itself.
                if let Some(w) = whole {
                    req.extensions_mut().insert(w);
                }
                if let Some(pr) = probe {
                    req.extensions_mut().insert(pr);
                }
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.router.call(req)))
                    .map_or(Start::Ended(true), Start::Handler)
            };
            started = Some((first, call, deadline, probed));
        }
        // For a request that came whole, its body has all this already (no inbox); it is
        // still counted against the call's window here.
        self.deliver(&p, data, data_len)?;
        // The handler runs once its request's first packet is in its body.
        if let Some((first, call, deadline, probe)) = started {
            let start = match first {
                Start::Handler(h) => answer_now(&self.st.mux, id, &call, h),
                other => other,
            };
            // A generated route takes its probe in its first poll, which has run by now.
            if let Some((path, pr)) = probe
                && self.router.learn(path, pr)
            {
                self.stats.learned_direct_route();
            }
            match start {
                Start::Done => self.st.lock().end(id, &call),
                start => self.go_on(id, call, start, deadline),
            }
        }
        Ok(())
    }

    /// A whole request on a direct route: answered here when its handler is ready at
    /// once, which then never enters the call table or gets a call state of its own.
    /// Only a call that goes on (its handler waits, its answer waits for room to send, or
    /// it panicked) is entered, before the next packet is read.
    fn dispatch_direct(
        &mut self,
        id: u32,
        route: &DirectRoute,
        msg: Bytes,
        headers: http::HeaderMap,
        timeout: Option<std::time::Duration>,
    ) -> Result<()> {
        let admitted = self.st.lock().admit(id)?;
        if let Admit::Refuse(status) = admitted {
            self.refuse(id, status);
            return Ok(());
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        let start = direct_now(&self.st.mux, id, route, msg, headers, self.extensions());
        if !matches!(start, Start::Done) {
            self.go_on_direct(id, start, deadline);
        }
        Ok(())
    }

    /// A direct call that did not finish in its first poll enters the call table and
    /// goes on as its own future. Out of line for the same reason as `dispatch_other`.
    #[inline(never)]
    fn go_on_direct(&mut self, id: u32, start: Start, deadline: Option<Instant>) {
        let call = CallShared::new();
        self.st.lock().insert(
            id,
            ServerCall {
                body: None,
                shared: call.clone(),
            },
        );
        self.go_on(id, call, start, deadline);
    }

    /// A call that goes on after the packet that started it: its future (made on this
    /// frame before it moves to the heap) joins the connection's running calls.
    #[inline(never)]
    fn go_on(&mut self, id: u32, call: Arc<CallShared>, start: Start, deadline: Option<Instant>) {
        self.running
            .push((self.start)(self.st.clone(), id, call, start, deadline));
    }

    /// What a handler finds in its request's extensions. A clone of the connection's
    /// map: the same allocations as inserting each entry, without hashing them and growing
    /// the table on every request.
    fn extensions(&self) -> http::Extensions {
        self.extensions.clone()
    }

    /// Hands what packet `p` carries (its body frame is `data`, of `data_len` bytes) to
    /// its call.
    fn deliver(&self, p: &Packet, data: Option<Bytes>, data_len: Option<usize>) -> Result<()> {
        let mut calls = self.st.lock();
        let c = match calls.packet(p, data_len) {
            Verdict::Dropped => return Ok(()),
            Verdict::Overrun(c) => {
                if let Some(b) = &c.body {
                    b.send(Inbound::Error(request_cut(
                        "the client overran the call's flow-control window",
                    )));
                }
                return Err(overrun(p.call));
            }
            Verdict::Call(Entry::Live(c) | Entry::Cancelled(c)) => c,
            // Only a client's table ends calls on a packet.
            Verdict::Call(Entry::Ended(_)) => return Ok(()),
        };
        let Some(b) = &c.body else {
            return Ok(());
        };
        if let Some(d) = data {
            b.send(Inbound::Data(d));
        }
        if p.end {
            b.send(Inbound::End);
        }
        if p.reset {
            // The client cancelled: the handler's future is dropped by `answer`.
            b.send(Inbound::Error(request_cut("the client cancelled the call")));
        }
        Ok(())
    }
}

/// A repeat with no head kept for it: a bug in the demultiplexer, which ends only this
/// connection.
fn lost_repeat(id: u32) -> Error {
    Error::Protocol(format!(
        "gRPC call framing: call {id} repeats a head that was not kept (an Ibex bug)"
    ))
}

/// As HTTP/2's FLOW_CONTROL_ERROR: no honest client sends past the window, and going on
/// would buffer whatever it sends next.
fn overrun(id: u32) -> Error {
    Error::Protocol(format!(
        "gRPC call framing: the client overran call {id}'s flow-control window of {} bytes",
        super::WINDOW
    ))
}

/// What a request stream says when its client went away before ending it. Not
/// `Cancelled`: tonic's decoder turns a `Cancelled` request-body error into a clean end of
/// the stream, and a handler (or a task it spawned) that commits at the end would commit a
/// truncated upload. `Unknown` is what stock tonic reports for a broken HTTP/2 body.
fn request_cut(why: &str) -> Status {
    Status::unknown(format!(
        "error reading the request stream: {why} before the stream ended; the data received is incomplete"
    ))
}

/// Where a call stands when its connection's task first takes it up.
enum Start {
    /// The service was not called: `true` when it panicked as it was called, `false` when
    /// the call was cancelled first.
    Ended(bool),
    /// The handler has not answered yet.
    Handler(Handler),
    /// The handler answered, and this is what is left of its response (boxed, as
    /// [`Now::Rest`]).
    Answered(Box<pump::Remainder<tonic::body::Body>>),
    /// The whole response is one packet, which waits for room in the send queue.
    Unsent(Encoded),
    /// The whole response went out.
    Done,
}

/// The first try at a call, on the task that read its request: a handler that is ready at
/// once (most unary ones) is answered here, and a response whose body is ready too goes
/// out as one packet with no future made for the call. Whatever would wait comes back to
/// run as the call's future: the handler, the response not yet complete, or a packet the
/// send queue has no room for yet.
fn answer_now(mux: &Mux, id: u32, call: &CallShared, mut handler: Handler) -> Start {
    if call.done.is_set() {
        // Cancelled before its handler ran.
        return Start::Ended(false);
    }
    let tried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // A handler left pending here is polled again by its future with the task's waker.
        let mut cx = Context::from_waker(Waker::noop());
        let resp = match handler.as_mut().poll(&mut cx) {
            Poll::Pending => return Start::Handler(handler),
            Poll::Ready(Ok(resp)) => resp,
            Poll::Ready(Err(never)) => match never {},
        };
        drop(handler);
        let (parts, body) = resp.into_parts();
        let head = response_head(id, parts.status, parts.headers);
        match pump::pump_now(mux, head, body, Side::Server) {
            Now::Sent => Start::Done,
            Now::Unsent(unsent) => Start::Unsent(unsent),
            Now::Rest(rest) => Start::Answered(rest),
            // The connection is failing; the client learns it from the connection.
            Now::Failed(s) => {
                tracing::debug!(status = %s.message(), call = id, "gRPC response not sent");
                Start::Done
            }
        }
    }));
    tried.unwrap_or(Start::Ended(true))
}

/// [`answer_now`] for a call on a direct route: its answer, when ready at once, is encoded
/// straight into one packet (head, message, `grpc-status: 0`) with no response or body
/// made for it. A call that would wait runs on as an ordinary handler.
fn direct_now(
    mux: &Mux,
    id: u32,
    route: &DirectRoute,
    msg: Bytes,
    headers: http::HeaderMap,
    extensions: http::Extensions,
) -> Start {
    let tried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut start = Start::Done;
        // As a route's error response goes: trailers-only, with the head's date.
        let refuse = |status: Status| {
            let (parts, ()) = status.into_http::<()>().into_parts();
            let mut pkt = response_head(id, parts.status, parts.headers);
            pkt.end = true;
            mux.send_now(pkt, None)
        };
        let mut reply = |answer: ReadyAnswer<'_>| {
            let sent = match answer {
                Ok((headers, frame)) => {
                    let mut pkt = response_head(id, http::StatusCode::OK, headers);
                    pkt.trailers = Some(Trailers::Ok);
                    pkt.end = true;
                    // Nothing of the answer went out when it fails (its message could not
                    // be encoded, or the connection is gone): the call still gets a status
                    // rather than waiting for its deadline.
                    mux.send_written_now(pkt, frame).or_else(|e| {
                        refuse(Status::internal(format!(
                            "the server could not send its response: {e}"
                        )))
                    })
                }
                Err(status) => refuse(status),
            };
            start = match sent {
                Ok(None) => Start::Done,
                Ok(Some(unsent)) => Start::Unsent(unsent),
                Err(e) => {
                    tracing::debug!(%e, call = id, "gRPC response not sent");
                    Start::Done
                }
            };
        };
        // A handler left pending here is polled again by its future with the task's waker.
        let mut cx = Context::from_waker(Waker::noop());
        match route.start(msg, headers, extensions, &mut cx, &mut reply) {
            Started::Answered => start,
            Started::Pending(fut) => {
                Start::Handler(Box::pin(async move { Ok(into_http(fut.await)) }))
            }
        }
    }));
    tried.unwrap_or(Start::Ended(true))
}

/// The head packet of a response.
fn response_head(id: u32, status: http::StatusCode, headers: http::HeaderMap) -> Packet {
    let mut head = Packet::new(id);
    // Content type and date, unless the service set them, go onto the wire with no map
    // entry made for them.
    head.head = Some(Head::Response {
        status,
        headers,
        standard: Some(date_header()),
    });
    head
}

async fn run_call(
    st: Arc<ConnState>,
    id: u32,
    call: Arc<CallShared>,
    start: Start,
    deadline: Option<Instant>,
) {
    let panicked = match start {
        Start::Handler(handler) => {
            std::panic::AssertUnwindSafe(answer(&st, id, &call, handler, deadline))
                .catch_unwind()
                .await
                .is_err()
        }
        Start::Answered(rest) => {
            let pump::Remainder { first, body } = *rest;
            std::panic::AssertUnwindSafe(pump(
                &st.mux,
                id,
                &call,
                first,
                body,
                Side::Server,
                deadline,
                None,
            ))
            .catch_unwind()
            .await
            .is_err()
        }
        Start::Unsent(unsent) => {
            if let Err(e) = unsent.send(&st.mux).await {
                tracing::debug!(%e, call = id, "gRPC response not sent");
            }
            false
        }
        Start::Ended(panicked) => panicked,
        Start::Done => false,
    };
    if panicked {
        // The panic has been reported by the hook; the client learns that its call died.
        tracing::error!(call = id, peer = %st.mux.conn.peer(), "gRPC handler panicked; resetting the call");
        let mut p = Packet::new(id);
        p.reset = true;
        let _ = st.mux.send(p, None).await;
    }
    st.lock().end(id, &call);
}

/// Runs the handler and sends its response, within the deadline and until cancelled.
async fn answer(
    st: &ConnState,
    id: u32,
    call: &CallShared,
    handler: Handler,
    deadline: Option<Instant>,
) {
    let sleep = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    if call.done.is_set() {
        // Cancelled before its handler ran.
        return;
    }
    // The handler first, as tonic's own deadline layer polls it: one that answers at once
    // never registers for cancellation or the deadline (a lock on the call's `Notify` and a
    // timer entry per call).
    let resp = tokio::select! {
        biased;
        r = handler => match r {
            Ok(resp) => Some(resp),
            Err(never) => match never {},
        },
        _ = call.done.wait() => None,
        _ = sleep => {
            // The handler is dropped here; the client learns why in a trailers-only answer.
            let late = Status::deadline_exceeded("Deadline expired before the handler answered");
            let _ = st.mux.send(trailers_only(id, late), None).await;
            None
        }
    };
    if let Some(resp) = resp {
        let (parts, body) = resp.into_parts();
        let head = response_head(id, parts.status, parts.headers);
        pump(
            &st.mux,
            id,
            call,
            (head, None),
            body,
            Side::Server,
            deadline,
            None,
        )
        .await;
    }
}
