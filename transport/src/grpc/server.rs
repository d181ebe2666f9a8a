//! The server: accepts Ibex connections and feeds their calls to tonic services.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::Status;
use tonic::service::Routes;

use super::body::{Budget, Charge, Held, IbexBody, Inbound, InboxTx, IncomingBody, inbox};
use super::calls::{Admit, CallTable, Entry, Slot, Verdict};
use super::demux::Demux;
use super::direct::{DirectRoute, ReadyAnswer, Started, direct_message, into_http};
use super::pump::{self, Now, Side, pump, trailers_only};
use super::router::{AddService, Handler, Services};
use super::wire::{Head, Limits, Packet, Trailers};
use super::{CallShared, Encoded, Flag, Mux, parse_timeout};
use crate::config::Config;
use crate::conn::{ConnStats, Connection, Listener};
use crate::error::{Error, Result};
use crate::link::RecvBuf;
use crate::pool::Pool;

/// tonic's connect info, under tonic's paths (`tonic::transport::server::TcpConnectInfo`).
pub use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

/// The gRPC server over Ibex. Start with [`Server::builder`].
#[derive(Debug)]
pub struct Server;

impl Server {
    /// A builder to add services to and then serve.
    pub fn builder() -> Builder {
        Builder::default()
    }
}

/// Collects services, then serves them: `Server::builder().add_service(svc).serve(addr)`.
#[derive(Debug, Default)]
pub struct Builder {
    /// The handlers of every service added, by method path and service name.
    services: Services,
    config: Option<Config>,
    /// Listener settings from tonic-named methods, applied over `config`.
    tcp_keepalive: Option<Option<std::time::Duration>>,
    connection_window: Option<u32>,
    keepalive_interval: Option<std::time::Duration>,
    keepalive_timeout: Option<std::time::Duration>,
    stats: ServerStats,
    limits: ServeLimits,
    /// TLS for tcp and HTTP/2 addresses ([`Builder::tls_config`]).
    tls: Option<super::ServerTlsConfig>,
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
    /// The server's budget over all connections ([`Config::max_memory`]), when set here.
    max_memory: Option<usize>,
}

/// The default of [`Builder::max_concurrent_calls`].
pub const DEFAULT_MAX_CONCURRENT_CALLS: usize = 4096;

impl Default for ServeLimits {
    fn default() -> ServeLimits {
        ServeLimits {
            wire: Limits::default(),
            max_concurrent_calls: DEFAULT_MAX_CONCURRENT_CALLS,
            keepalive: None,
            max_held: crate::config::DEFAULT_RNDV_RECV_BUDGET,
            max_memory: None,
        }
    }
}

/// The transport counters of a server's connections, for metrics: take it with
/// [`Builder::stats`] before serving, read it at any time while (and after) the server runs.
#[derive(Debug, Clone, Default)]
pub struct ServerStats {
    inner: Arc<Mutex<StatsInner>>,
    routes: Arc<RouteCounters>,
}

#[derive(Debug, Default)]
struct StatsInner {
    next: u64,
    live: HashMap<u64, Connection>,
    /// Counters of connections that have ended, so totals never go backwards.
    closed: ConnStats,
    closed_count: u64,
    /// The server's memory budget, once it serves.
    budget: Option<Arc<Budget>>,
}

/// How many calls a server has handled, by route: a direct handler or the adapter over Ibex;
/// calls over stock HTTP/2 (`serve_any` with an `http://` address) are counted apart.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RouteCounts {
    /// Unary calls of an ibex-codegen service (added as its `*_ibex` server) answered by the
    /// method's direct handler, with no `http::Request`, tower service or response body.
    pub direct: u64,
    /// Calls through a service's tonic route: streaming calls, tonic-only services, services
    /// behind interceptors or layers, and unary calls the direct handler does not take.
    pub adapter: u64,
    /// Calls over stock HTTP/2.
    pub http2: u64,
}

#[derive(Debug, Default)]
struct RouteCounters {
    direct: std::sync::atomic::AtomicU64,
    adapter: std::sync::atomic::AtomicU64,
    http2: std::sync::atomic::AtomicU64,
}

impl RouteCounters {
    fn add(counter: &std::sync::atomic::AtomicU64) {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
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

    /// How many calls took each route so far. A generated unary call counts as `direct` only
    /// when its service was added as its `*_ibex` server, not behind an interceptor or layer.
    pub fn routes(&self) -> RouteCounts {
        let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        RouteCounts {
            direct: get(&self.routes.direct),
            adapter: get(&self.routes.adapter),
            http2: get(&self.routes.http2),
        }
    }

    /// What the server's clients make it hold now, in bytes, and its budget
    /// ([`Config::max_memory`]); `(0, 0)` before it serves.
    pub fn memory(&self) -> (usize, usize) {
        self.lock()
            .budget
            .as_ref()
            .map_or((0, 0), |b| (b.used(), b.limit()))
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

    /// The transport configuration for accepted connections (default `Config::default()`;
    /// pass [`Config::from_env`] for the `IBEX_*` environment).
    pub fn config(mut self, config: Config) -> Self {
        self.config = Some(config);
        self
    }

    /// Serves over TLS, as tonic's `Server::builder().tls_config(..)`: on `tcp://` the
    /// handshake runs before the Ibex preface; on `http://`/`https://` ([`Builder::serve_any`])
    /// stock tonic serves TLS. shm ignores it (a local peer, checked by the kernel's
    /// credentials); verbs refuses it. The settings are checked here: a missing identity or
    /// a key that is no PEM key is an error now, not at the first client.
    pub fn tls_config(mut self, tls: super::ServerTlsConfig) -> Result<Self> {
        tls.rustls()?;
        self.tls = Some(tls);
        Ok(self)
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

    /// Pings each client connection after this long without hearing from it, and closes it
    /// when no answer comes within [`Builder::http2_keepalive_timeout`] (default 20 s), so a
    /// hung or vanished client stops holding its calls ([`Config::keepalive`]).
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

    /// tonic's connection window: the request body bytes one connection may hold for handlers
    /// that have not taken them (default 256 MiB; past it the server stops reading that
    /// client), and [`Config::rndv_recv_budget`], a listener setting as
    /// [`Builder::tcp_keepalive`] is.
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

    /// Adds a service: a generated tonic service or anything tonic's router takes (a service
    /// with an interceptor or tower layers), whose calls all go through it; or an ibex-codegen
    /// server (`greeter_ibex::GreeterServer::new(..)`), whose unary methods are answered by
    /// their direct handlers.
    pub fn add_service<K, S: AddService<K>>(mut self, svc: S) -> Self {
        svc.add_to(&mut self.services);
        self
    }

    /// The server's budget for what its clients make it hold, over all connections
    /// ([`Config::max_memory`], which this overrides).
    pub fn max_memory(mut self, bytes: usize) -> Self {
        self.limits.max_memory = Some(bytes);
        self
    }

    /// Adds every service of `routes`.
    pub fn add_routes(mut self, routes: Routes) -> Self {
        self.services.add_routes(routes);
        self
    }

    /// Listens on `addr` and serves until an error, as tonic's `serve` (so
    /// `let addr = "[::1]:50051".parse()?;` works unchanged): over every provider a client
    /// may come by, as `ibex://addr` ([`crate::listen_auto`]): tcp at `addr`, shm for
    /// clients on this host, and verbs where there is an RDMA device. A client connecting
    /// to `ibex://host:port` takes the best of them; `tcp://host:port` takes tcp.
    pub async fn serve(self, addr: std::net::SocketAddr) -> Result<()> {
        self.serve_uri(&format!("ibex://{addr}")).await
    }

    /// Like [`Builder::serve`], until `signal` completes; then stops accepting, tells
    /// clients to make no new calls, lets the calls in flight finish, and returns.
    pub async fn serve_with_shutdown<F: Future<Output = ()>>(
        self,
        addr: std::net::SocketAddr,
        signal: F,
    ) -> Result<()> {
        self.serve_uri_with_shutdown(&format!("ibex://{addr}"), signal)
            .await
    }

    /// Listens on an Ibex address (`shm:///path.sock`, `tcp://host:port`,
    /// `verbs://host:port`, `ibex://host:port`) and serves until an error.
    pub async fn serve_uri(self, uri: &str) -> Result<()> {
        self.serve_uri_with_shutdown(uri, std::future::pending())
            .await
    }

    /// Like [`Builder::serve_uri`], until `signal` completes, as
    /// [`Builder::serve_with_shutdown`].
    pub async fn serve_uri_with_shutdown<F: Future<Output = ()>>(
        self,
        uri: &str,
        signal: F,
    ) -> Result<()> {
        let mut config = match &self.config {
            Some(c) => c.clone(),
            None => Config::default(),
        };
        if let Some(k) = self.tcp_keepalive {
            config.tcp_keepalive = k;
        }
        if let Some(w) = self.connection_window {
            config.rndv_recv_budget = w as usize;
        }
        if let Some(t) = &self.tls {
            config.tls = Some(crate::tls::Tls::server(t.rustls()?));
            if let Some(d) = t.handshake_timeout() {
                config.handshake_timeout = d;
            }
        }
        let listener = crate::conn::listen(uri, config).await?;
        self.serve_with_listener(listener, signal).await
    }

    /// Serves on any address: an Ibex one (`shm://`, `tcp://`, `verbs://`) like
    /// [`Builder::serve_uri_with_shutdown`], or `http://host:port` with stock tonic's HTTP/2
    /// server and the same services, so one program serves both kinds of deployment
    /// (`https://host:port` too, with [`Builder::tls_config`], which applies to both).
    /// Over HTTP/2 requests carry no [`PeerHandle`] and [`Builder::stats`] stays empty.
    pub async fn serve_any<F: Future<Output = ()>>(self, uri: &str, signal: F) -> Result<()> {
        let Some(host_port) = uri
            .strip_prefix("http://")
            .or_else(|| uri.strip_prefix("https://"))
        else {
            return self.serve_uri_with_shutdown(uri, signal).await;
        };
        if uri.starts_with("https://") && self.tls.is_none() {
            return Err(Error::Config(format!(
                "{uri}: an https:// address needs TLS settings; add Builder::tls_config(ServerTlsConfig::new().identity(..))"
            )));
        }
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
        let routes = self.services.routes();
        let stats = self.stats.routes.clone();
        let mut server = tonic::transport::Server::builder();
        if let Some(t) = &self.tls {
            server = server
                .tls_config(t.tonic())
                .map_err(|e| Error::Config(format!("TLS settings for HTTP/2: {e}")))?;
        }
        server
            .tcp_nodelay(true)
            .tcp_keepalive(self.tcp_keepalive.flatten())
            .http2_keepalive_interval(keepalive.map(|k| k.0))
            .http2_keepalive_timeout(keepalive.map(|k| k.1))
            .initial_connection_window_size(self.connection_window)
            .max_concurrent_streams(u32::try_from(self.limits.max_concurrent_calls).ok())
            .layer(tower::util::MapRequestLayer::new(
                move |req: http::Request<tonic::body::Body>| {
                    RouteCounters::add(&stats.http2);
                    req
                },
            ))
            .add_routes(routes)
            .serve_with_shutdown(addr, signal)
            .await
            .map_err(|e| Error::Io {
                context: format!("serving gRPC over HTTP/2 on {addr}"),
                source: std::sync::Arc::new(std::io::Error::other(e.to_string())),
            })
    }

    /// Serves on a listener made beforehand (e.g. to learn its `local_uri` first). The
    /// listener's own [`Config::tls`] applies ([`ServerTlsConfig::transport`](super::ServerTlsConfig::transport)
    /// makes one); with [`Builder::tls_config`] set, a listener made without TLS is an
    /// error rather than served in clear.
    pub async fn serve_with_listener<F: Future<Output = ()>>(
        self,
        listener: Listener,
        signal: F,
    ) -> Result<()> {
        if self.tls.is_some() && !listener.is_tls() && listener.local_uri().starts_with("tcp://") {
            // Serving in clear what the caller asked to be encrypted is never the intent.
            return Err(Error::Config(format!(
                "Builder::tls_config is set, but the listener at {} was made without TLS: make it with Config {{ tls: Some(server_tls.transport()?), .. }}, or let the builder listen (serve, serve_any)",
                listener.local_uri()
            )));
        }
        let mut limits = self.limits;
        limits.keepalive = self.keepalive();
        let max_memory = match (limits.max_memory, &self.config) {
            (Some(m), _) => m,
            (None, Some(c)) => c.max_memory,
            (None, None) => crate::config::default_max_memory(),
        };
        let budget = Budget::new(max_memory);
        self.stats.lock().budget = Some(budget.clone());
        let mut services = self.services;
        services.prepare();
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
                        let (services, shutdown) = (services.clone(), shutdown.clone());
                        let budget = budget.clone();
                        let home = conn.home().cloned();
                        let served = async move {
                            serve_conn(conn, services, shutdown, limits, budget, stats.clone()).await;
                            stats.remove(id);
                        };
                        match home {
                            // On its serve thread, where its driver runs, with this runtime
                            // entered: what a handler spawns runs here, as over stock tonic.
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

/// Whole seconds since the Unix epoch, for the `date` header. On Linux from the coarse clock,
/// which reads the kernel's last tick instead of the timestamp counter (costly under a VM).
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
    /// The call's place in its connection's account, while it is in the table.
    _charge: Charge,
}

/// What a call in flight is taken to hold against the server's budget besides its body
/// bytes: its handler's future, its table entry and inbox, and a small answer. Calls are
/// counted this way, not measured, so that accounting costs two atomic adds per call.
const CALL_COST: usize = 16 << 10;

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
type StartCall<F> = fn(Arc<ConnState>, u32, Arc<CallShared>, Start, Option<Instant>, Charge) -> F;

/// What one connection's task needs besides the connection.
struct ConnCtx<F> {
    st: Arc<ConnState>,
    /// What every request's extensions hold (see [`ConnCtx::extensions`]).
    extensions: http::Extensions,
    services: Services,
    stats: ServerStats,
    /// Body bytes held for this connection's handlers (see [`Held`]).
    held: Arc<Held>,
    draining: bool,
    /// A refusal the send queue had no room for: the connection reads nothing more until it
    /// is sent, so refusing costs the same memory however many calls a client piles up.
    refused: Option<Encoded>,
    /// The calls in flight, run on this task, which reads the connection: a handler ready at
    /// once answers in the poll that brought its request, with no task hop.
    running: FuturesUnordered<F>,
    start: StartCall<F>,
}

/// The extensions every request on `conn` carries: the peer, as `PeerHandle` and
/// [`ConnectInfo`], as tonic's `TcpConnectInfo` where it has a socket address, and as
/// tonic's `TlsConnectInfo` over TLS.
fn request_extensions(conn: &Connection) -> http::Extensions {
    let info = ConnectInfo::of(conn);
    let mut extensions = http::Extensions::new();
    if let Some(a) = info.remote_addr {
        extensions.insert(tonic::transport::server::TcpConnectInfo {
            local_addr: conn.local_addr(),
            remote_addr: Some(a),
        });
    }
    // Over TLS, as tonic's TLS server does: `Request::peer_certs()` reads it.
    if let Some(info) = conn.tls_peer().and_then(|t| t.connect_info.clone()) {
        extensions.insert(info);
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
    services: Services,
    shutdown: Arc<Flag>,
    limits: ServeLimits,
    budget: Arc<Budget>,
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
        services,
        stats,
        held: Held::new(limits.max_held, budget),
        draining: false,
        refused: None,
        running: FuturesUnordered::new(),
        start: run_call,
    };
    let mut demux = Demux::new(true, limits.wire);
    let held = cx.held.clone();
    let peer = conn.peer();
    // Why the connection is closed from this side, for the peer's error.
    let mut broken = String::new();
    // One wait for the whole connection, polled once here (leaving this task's waker with the
    // `Notify`) and after that only once the flag is set: a fresh wait or a poll per message
    // would take the `Notify`'s lock. The flag is read inside the branch's future, since a
    // precondition is read once per `select!` and a wake-up re-polls that same `select!`.
    let stop = shutdown.wait();
    tokio::pin!(stop);
    // `true` when the server was stopping already: `stop` is done and must not be polled.
    let stopped = std::future::poll_fn(|c| Poll::Ready(stop.as_mut().poll(c).is_ready())).await;
    let mut refusing = None;
    loop {
        if let Some(r) = cx.refused.take() {
            let mux = cx.st.mux.clone();
            refusing = Some(Box::pin(async move { r.send(&mux).await }));
        }
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
            // A refusal waits for send room before anything more is read.
            sent = async {
                match refusing.as_mut() {
                    Some(r) => r.await,
                    None => std::future::pending().await,
                }
            }, if refusing.is_some() => {
                refusing = None;
                if let Err(e) = sent {
                    tracing::debug!(%e, "gRPC server: connection ended while refusing a call");
                    break;
                }
            }
            // Handlers have not taken what they hold: read nothing more until they do.
            () = held.below(), if held.over() && refusing.is_none() => {}
            // A client that leaves while we hold its bodies, or while a refusal waits for it,
            // ends its calls all the same.
            () = conn.closed(), if held.over() || refusing.is_some() => {
                tracing::debug!("gRPC server: connection ended while paused");
                break;
            }
            msg = std::future::poll_fn(|c| conn.poll_recv_parts(c)), if !held.over() && refusing.is_none() => {
                let msg = match msg {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::debug!(%e, "gRPC server: connection ended");
                        break;
                    }
                };
                let r = demux.push(msg).and_then(|(p, data)| cx.dispatch(p, data));
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
    drop(cx);
    conn.close_with(&broken).await;
    let received = conn.stats().proto;
    let received = received.eager_bytes_recv + received.rndv_bytes_recv;
    if held
        .budget()
        .ended(usize::try_from(received).unwrap_or(usize::MAX), TRIM_AFTER)
    {
        give_back_freed_memory();
    }
}

/// Once the connections that ended have received this much since the last time, the freed
/// memory goes back to the system, so the resident size falls after clients that made the
/// server allocate much (the allocator keeps freed memory for reuse, and `ibex-ps` asks it
/// to keep all of it: [`crate::conn::keep_freed_memory`]).
const TRIM_AFTER: usize = 16 << 20;

fn give_back_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free memory of glibc's heap to the system; it takes
    // the allocator's own locks and touches no memory in use.
    unsafe {
        libc::malloc_trim(0);
    }
}

impl<F: Future<Output = ()>> ConnCtx<F> {
    /// The one dispatch for every packet a client sends. A request head opens a call (admitted
    /// against the call table's limit) and starts its handler, looked up by its path: the
    /// direct handler for a request that came whole as one plain message, else the adapter.
    /// Any other packet goes to the call it names.
    fn dispatch(&mut self, mut p: Packet, data: Option<Bytes>) -> Result<()> {
        let data_len = data.as_ref().map(Bytes::len);
        let Some(Head::Request { path, headers, .. }) = p.head.take() else {
            return self.deliver(&p, data, data_len);
        };
        let id = p.call;
        // A request that came whole in this packet (a unary one) needs no inbox.
        let whole = p.end && !p.reset;
        if whole && p.window.is_none() && !p.goaway {
            let direct = self.services.direct(path.as_str()).and_then(|route| {
                let (msg, timeout) = direct_message(&headers, data.as_ref()?, route.max_decoding)?;
                Some((route, msg, timeout))
            });
            if let Some((route, msg, timeout)) = direct {
                if let Some(status) = self.refusal(id)? {
                    self.refuse(id, status);
                    return Ok(());
                }
                RouteCounters::add(&self.stats.routes.direct);
                let deadline = timeout.map(|t| Instant::now() + t);
                let extensions = self.extensions();
                let start = direct_now(&self.st.mux, id, route, msg, headers, extensions);
                // A call answered in this poll needs no call state: nothing else of the
                // connection runs until it is done. One that goes on enters the call table
                // before the next packet is read, as every other call does.
                if !matches!(start, Start::Done) {
                    let call = CallShared::new();
                    let entry = ServerCall {
                        body: None,
                        shared: call.clone(),
                        _charge: self.held.charge(CALL_COST),
                    };
                    self.st.lock().insert(id, entry);
                    self.go_on(id, call, start, deadline);
                }
                return Ok(());
            }
        }
        let call = CallShared::new();
        let (tx, rx) = match (!whole).then(|| inbox(Some(self.held.clone()))) {
            Some((tx, rx)) => (Some(tx), Some(rx)),
            None => (None, None),
        };
        if let Some(status) = self.refusal(id)? {
            self.refuse(id, status);
            return Ok(());
        }
        let entry = ServerCall {
            body: tx,
            shared: call.clone(),
            _charge: self.held.charge(CALL_COST),
        };
        self.st.lock().insert(id, entry);
        // A streamed request's frame counts against the call's window and goes to its
        // inbox. A whole request's frame goes to its handler: it ends the client's side of
        // the call, so nothing after it is accounted (unless the packet also grants window
        // or says GOAWAY, which the table applies).
        let data = match rx {
            Some(_) => {
                self.deliver(&p, data, data_len)?;
                None
            }
            None if p.window.is_some() || p.goaway => {
                self.deliver(&p, None, data_len)?;
                data
            }
            None => data,
        };
        let (start, deadline) = if p.reset {
            // The client cancelled with its first packet: no handler runs.
            (Start::Ended(false), None)
        } else {
            RouteCounters::add(&self.stats.routes.adapter);
            let deadline = parse_timeout(&headers).map(|t| Instant::now() + t);
            let body = match rx {
                Some(rx) => IncomingBody::from(IbexBody::new(
                    rx,
                    self.st.mux.clone(),
                    id,
                    call.clone(),
                    || request_cut("the client's connection is gone"),
                )),
                None => IncomingBody::complete(data, None, Some(self.held.clone())),
            };
            (self.adapter(id, &call, path, headers, body), deadline)
        };
        match start {
            Start::Done => self.st.lock().end(id, &call),
            start => self.go_on(id, call, start, deadline),
        }
        Ok(())
    }

    /// Starts a call on its service's tonic route, calling the connection's clone of the
    /// service here: a panic in its synchronous part (an interceptor, a layer) must fail only
    /// this call. Out of line, so its several KiB of stack are not reserved on direct calls.
    #[inline(never)]
    fn adapter(
        &mut self,
        id: u32,
        call: &CallShared,
        path: http::uri::PathAndQuery,
        headers: http::HeaderMap,
        body: IncomingBody,
    ) -> Start {
        let mut req = http::Request::new(tonic::body::Body::new(body));
        *req.method_mut() = http::Method::POST;
        *req.uri_mut() = http::Uri::from(path);
        *req.version_mut() = http::Version::HTTP_2;
        *req.headers_mut() = headers;
        *req.extensions_mut() = self.extensions();
        let services = &mut self.services;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| services.call(req))) {
            Ok(handler) => answer_now(&self.st.mux, id, call, handler),
            Err(_) => Start::Ended(true),
        }
    }

    /// Why call `id`, whose request head just came, is not taken, if it is not: the
    /// connection's limit on calls, a draining server, or the server's memory budget.
    fn refusal(&self, id: u32) -> Result<Option<Status>> {
        if let Admit::Refuse(status) = self.st.lock().admit(id)? {
            return Ok(Some(status));
        }
        Ok(self.held.refusal())
    }

    /// A trailers-only answer to a call that never reaches a handler: sent now, or kept
    /// (one at most) while the connection reads nothing more.
    fn refuse(&mut self, id: u32, status: Status) {
        match self.st.mux.send_now(trailers_only(id, status), None) {
            Ok(None) => {}
            Ok(Some(unsent)) => self.refused = Some(unsent),
            Err(e) => tracing::debug!(%e, call = id, "gRPC refusal not sent"),
        }
    }

    /// A call that goes on after the packet that started it: its future (made on this
    /// frame before it moves to the heap) joins the connection's running calls.
    #[inline(never)]
    fn go_on(&mut self, id: u32, call: Arc<CallShared>, start: Start, deadline: Option<Instant>) {
        // An answer that waits for send room is held for the client too.
        let waiting = match &start {
            Start::Unsent(unsent) => self.held.charge(unsent.len()),
            _ => self.held.charge(0),
        };
        self.running.push((self.start)(
            self.st.clone(),
            id,
            call,
            start,
            deadline,
            waiting,
        ));
    }

    /// What a handler finds in its request's extensions: a clone of the connection's map,
    /// which saves hashing each entry and growing the table on every request.
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

/// As HTTP/2's FLOW_CONTROL_ERROR: no honest client sends past the window, and going on
/// would buffer whatever it sends next.
fn overrun(id: u32) -> Error {
    Error::Protocol(format!(
        "gRPC call framing: the client overran call {id}'s flow-control window of {} bytes",
        super::WINDOW
    ))
}

/// What a request stream says when its client went away before ending it: `Unknown`, as
/// stock tonic reports a broken HTTP/2 body. Not `Cancelled`, which tonic's decoder turns
/// into a clean end, so a handler committing at the end would commit a truncated upload.
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

/// The first try at a call, on the task that read its request: a handler ready at once (most
/// unary ones) is answered here, and a response whose body is ready too goes out as one
/// packet with no future. What would wait comes back to run as the call's future.
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

/// [`answer_now`] for a direct route: an answer ready at once is encoded straight into one
/// packet (head, message, `grpc-status: 0`); a call that would wait runs as a handler.
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
                    // Nothing went out when it fails (a message that could not be encoded, a
                    // gone connection): the call still gets a status, not its deadline.
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
    waiting: Charge,
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
            drop(waiting);
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
    // The handler first, as tonic's deadline layer polls it: one that answers at once never
    // registers for cancellation or the deadline (a lock and a timer entry per call).
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
