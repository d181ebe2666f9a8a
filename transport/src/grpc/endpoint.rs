//! [`Endpoint`]: where a [`Channel`] connects and with which settings, in the shape of
//! tonic's `Endpoint`.

use std::sync::Arc;

use bytes::Bytes;

use super::client::{Channel, Inner, Kind, Settings, Target};
use super::wire::Limits;
use crate::config::Config;
use crate::error::{Error, Result};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where a channel connects, and its settings, as tonic's `Endpoint`:
/// `Endpoint::from_static("tcp://10.0.0.2:50051").connect_timeout(..).timeout(..).connect()`.
/// The address is an Ibex one (`shm:///path.sock`, `tcp://host:port`, `verbs://host:port`)
/// or `http://` / `https://` (stock HTTP/2 through tonic's own endpoint, with the same
/// settings), and is checked when the endpoint is made.
#[derive(Clone)]
pub struct Endpoint {
    uri: String,
    config: Option<Config>,
    settings: Settings,
    concurrency: Option<usize>,
    max_header_list_size: usize,
    tcp_keepalive: Option<Option<std::time::Duration>>,
    keepalive_interval: Option<std::time::Duration>,
    keepalive_timeout: Option<std::time::Duration>,
    connection_window: Option<u32>,
    /// Settings that only stock HTTP/2 has, passed on for `http://` addresses.
    stream_window: Option<u32>,
    buffer_size: Option<usize>,
    /// TLS as given (for `http(s)://`), and as the transport takes it (for `tcp://`).
    tls: Option<(super::ClientTlsConfig, crate::tls::Tls)>,
    origin: Option<http::Uri>,
    http2_reset: Http2Reset,
    /// At most this many calls per period.
    rate: Option<(u64, std::time::Duration)>,
}

/// HTTP/2 reset-stream settings, passed on for `http://` addresses only.
#[derive(Clone, Copy, Default)]
struct Http2Reset {
    max_concurrent: Option<usize>,
    duration: Option<std::time::Duration>,
    max_local_error: Option<Option<usize>>,
}

/// `http://` and `https://` addresses go to stock HTTP/2.
pub(super) fn is_http(uri: &str) -> bool {
    uri.starts_with("http://") || uri.starts_with("https://")
}

impl TryFrom<&str> for Endpoint {
    type Error = Error;

    fn try_from(s: &str) -> Result<Endpoint> {
        Endpoint::parse(s.to_string())
    }
}

impl TryFrom<String> for Endpoint {
    type Error = Error;

    fn try_from(s: String) -> Result<Endpoint> {
        Endpoint::parse(s)
    }
}

impl TryFrom<&String> for Endpoint {
    type Error = Error;

    fn try_from(s: &String) -> Result<Endpoint> {
        Endpoint::parse(s.clone())
    }
}

impl TryFrom<Bytes> for Endpoint {
    type Error = Error;

    fn try_from(b: Bytes) -> Result<Endpoint> {
        Endpoint::from_shared(b)
    }
}

impl TryFrom<http::Uri> for Endpoint {
    type Error = Error;

    fn try_from(uri: http::Uri) -> Result<Endpoint> {
        // `http::Uri` shows an empty path as `/`, which an Ibex `host:port` must not end in.
        let s = match (uri.scheme_str(), uri.authority()) {
            (Some(scheme), Some(a))
                if !is_http(&uri.to_string()) && uri.path() == "/" && uri.query().is_none() =>
            {
                format!("{scheme}://{a}")
            }
            _ => uri.to_string(),
        };
        Endpoint::parse(s)
    }
}

impl std::str::FromStr for Endpoint {
    type Err = Error;

    fn from_str(s: &str) -> Result<Endpoint> {
        Endpoint::parse(s.to_string())
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("uri", &self.uri)
            .finish_non_exhaustive()
    }
}

impl Channel {
    /// An [`Endpoint`] for a fixed address, as tonic's `Channel::from_static`.
    ///
    /// # Panics
    /// If `s` is not an address; see [`Endpoint::from_static`].
    pub fn from_static(s: &'static str) -> Endpoint {
        Endpoint::from_static(s)
    }

    /// An [`Endpoint`] for an address given at run time, as tonic's `Channel::from_shared`.
    pub fn from_shared(s: impl Into<Bytes>) -> Result<Endpoint> {
        Endpoint::from_shared(s)
    }

    /// An [`Endpoint`] for `uri` (`tcp://host:port`, `http://host:port`, ...), as tonic's
    /// `Channel::builder`.
    ///
    /// # Panics
    /// If `uri` is not an address Ibex or stock HTTP/2 connects to (an shm path cannot be
    /// an `http::Uri`; use [`Endpoint::from_shared`] for it).
    pub fn builder(uri: http::Uri) -> Endpoint {
        match Endpoint::try_from(uri) {
            Ok(e) => e,
            Err(e) => panic!("Channel::builder: {e}"),
        }
    }
}

impl Endpoint {
    /// An endpoint for `dst`: a string or an [`http::Uri`] holding an address (or an
    /// `Endpoint`), as tonic's `Endpoint::new`. A bad address is an error naming it.
    pub fn new<D>(dst: D) -> Result<Endpoint>
    where
        D: TryInto<Endpoint>,
        D::Error: Into<BoxError>,
    {
        dst.try_into().map_err(|e| {
            let e: BoxError = e.into();
            match e.downcast::<Error>() {
                Ok(e) => *e,
                Err(e) => Error::Address {
                    addr: String::new(),
                    why: e.to_string(),
                },
            }
        })
    }

    /// An endpoint for a fixed address, as tonic's `Endpoint::from_static`.
    ///
    /// # Panics
    /// If `s` is not an address (as tonic's does for a URI it cannot parse): the message
    /// says what is wrong and which forms there are. Use [`Endpoint::from_shared`] for
    /// addresses that come from outside the program.
    pub fn from_static(s: &'static str) -> Endpoint {
        match Endpoint::parse(s.to_string()) {
            Ok(e) => e,
            Err(e) => panic!("Endpoint::from_static: {e}"),
        }
    }

    /// An endpoint for an address given at run time (bytes or a string), as tonic's
    /// `Endpoint::from_shared`.
    pub fn from_shared(s: impl Into<Bytes>) -> Result<Endpoint> {
        let bytes: Bytes = s.into();
        let uri = String::from_utf8(bytes.to_vec()).map_err(|e| Error::Address {
            addr: String::from_utf8_lossy(&bytes).into_owned(),
            why: format!("not UTF-8: {e}"),
        })?;
        Endpoint::parse(uri)
    }

    /// Checks `uri` and makes an endpoint for it with no settings yet.
    fn parse(uri: String) -> Result<Endpoint> {
        if is_http(&uri) {
            http::Uri::try_from(uri.as_str()).map_err(|e| Error::Address {
                addr: uri.clone(),
                why: format!("not a URI: {e}"),
            })?;
        } else {
            crate::conn::Addr::parse(&uri)?;
        }
        Ok(Endpoint {
            uri,
            config: None,
            settings: Settings::default(),
            concurrency: None,
            max_header_list_size: super::wire::DEFAULT_MAX_HEADER_LIST_SIZE,
            tcp_keepalive: None,
            keepalive_interval: None,
            keepalive_timeout: None,
            connection_window: None,
            stream_window: None,
            buffer_size: None,
            tls: None,
            rate: None,
            origin: None,
            http2_reset: Http2Reset::default(),
        })
    }

    /// The address, as given.
    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// The transport configuration (default `Config::default()`; pass [`Config::from_env`]
    /// for the `IBEX_*` environment).
    pub fn config(mut self, config: Config) -> Self {
        self.config = Some(config);
        self
    }

    /// How long connecting (and each reconnect) may take.
    pub fn connect_timeout(mut self, t: std::time::Duration) -> Self {
        self.settings.connect_timeout = Some(t);
        self
    }

    /// The deadline of every call that sets none, and a cap on those that set a longer one;
    /// the server is told (`grpc-timeout`) and drops the handler when it passes.
    pub fn timeout(mut self, t: std::time::Duration) -> Self {
        self.settings.timeout = Some(t);
        self
    }

    /// Calls in flight at once on the channel (all clones); more wait for a slot.
    pub fn concurrency_limit(mut self, n: usize) -> Self {
        self.concurrency = Some(n.max(1));
        self
    }

    /// TCP keep-alive on tcp connections ([`Config::tcp_keepalive`]): a server that vanished
    /// without closing is noticed within about twice `idle`, and the calls in flight fail
    /// `Unavailable` (tonic's `tcp_keepalive`).
    pub fn tcp_keepalive(mut self, idle: Option<std::time::Duration>) -> Self {
        self.tcp_keepalive = Some(idle);
        self
    }

    /// Pings the server after this long without hearing from it and fails the connection
    /// (and the calls on it, `Unavailable`) when no answer comes within
    /// [`Endpoint::keep_alive_timeout`] (20 s unless set), on every transport: tonic's
    /// HTTP/2 keep-alive (see [`Config::keepalive`]). The next call reconnects.
    pub fn http2_keep_alive_interval(mut self, interval: std::time::Duration) -> Self {
        self.keepalive_interval = Some(interval).filter(|i| !i.is_zero());
        self
    }

    /// How long a keep-alive ping may go unanswered (default 20 s, as tonic's).
    pub fn keep_alive_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.keepalive_timeout = Some(timeout).filter(|t| !t.is_zero());
        self
    }

    /// Accepted for tonic compatibility: Ibex pings whenever the connection is quiet, with
    /// calls in flight or not, so there is nothing to turn on.
    pub fn keep_alive_while_idle(self, enabled: bool) -> Self {
        let _ = enabled;
        self
    }

    /// What tonic calls the connection window: here the receive memory the connection may
    /// hold for messages in flight ([`Config::rndv_recv_budget`]).
    pub fn initial_connection_window_size(mut self, bytes: impl Into<Option<u32>>) -> Self {
        self.connection_window = bytes.into().filter(|&b| b > 0);
        self
    }

    /// A call's flow-control window over `http://`. Over Ibex a call's window is fixed at
    /// 8 MiB (bodies travel in pieces of at most 8 MiB; see docs/grpc.md).
    pub fn initial_stream_window_size(mut self, bytes: impl Into<Option<u32>>) -> Self {
        self.stream_window = bytes.into();
        self
    }

    /// Requests tonic's channel may buffer over `http://`. An Ibex channel has no request
    /// buffer to size: a call goes onto the connection from the task that makes it.
    pub fn buffer_size(mut self, n: impl Into<Option<usize>>) -> Self {
        self.buffer_size = n.into();
        self
    }

    /// Accepted for tonic compatibility: Ibex's tcp connections always set `TCP_NODELAY`.
    pub fn tcp_nodelay(self, enabled: bool) -> Self {
        let _ = enabled;
        self
    }

    /// tonic's name for [`Endpoint::max_header_list_size`].
    pub fn http2_max_header_list_size(self, size: u32) -> Self {
        self.max_header_list_size(size as usize)
    }

    /// HTTP/2-only settings with no counterpart on an Ibex connection, accepted so that a
    /// tonic `Endpoint` chain compiles unchanged; each says what stands in its place.
    /// Flow control here is the fixed per-call window and the connection window
    /// ([`Endpoint::initial_connection_window_size`]).
    pub fn http2_adaptive_window(self, enabled: bool) -> Self {
        let _ = enabled;
        self
    }

    /// Accepted for tonic compatibility: Ibex has no HPACK table (headers travel as a
    /// plain list, bounded by [`Endpoint::max_header_list_size`]).
    pub fn http2_header_table_size(self, size: u32) -> Self {
        let _ = size;
        self
    }

    /// Accepted for tonic compatibility: Ibex frames are sized by the transport
    /// (`Config::slot_size`, `Config::max_message_size`).
    pub fn max_frame_size(self, size: impl Into<Option<u32>>) -> Self {
        let _ = size.into();
        self
    }

    /// TCP keep-alive probe interval and count: the kernel's defaults apply, with the idle
    /// time from [`Endpoint::tcp_keepalive`] (three probes a third of it apart).
    pub fn tcp_keepalive_interval(self, interval: Option<std::time::Duration>) -> Self {
        let _ = interval;
        self
    }

    /// See [`Endpoint::tcp_keepalive_interval`].
    pub fn tcp_keepalive_retries(self, retries: Option<u32>) -> Self {
        let _ = retries;
        self
    }

    /// A user-agent put before tonic's and Ibex's own (`Greeter tonic/0.14 ibex/..`), as
    /// tonic's `Endpoint::user_agent`; an error if it is not a valid header value.
    pub fn user_agent<T>(mut self, user_agent: T) -> Result<Self>
    where
        T: TryInto<http::HeaderValue>,
    {
        let value = user_agent.try_into().map_err(|_| Error::Address {
            addr: self.uri.clone(),
            why: "the user agent is not a valid header value (visible ASCII only)".into(),
        })?;
        self.settings.user_agent = Some(value);
        Ok(self)
    }

    /// The `:authority` and scheme requests carry over `http://`, as tonic's
    /// `Endpoint::origin`. An Ibex call carries its path only, so it has no effect there.
    pub fn origin(mut self, origin: http::Uri) -> Self {
        self.origin = Some(origin);
        self
    }

    /// At most `limit` calls start per `duration` on the channel (all clones); more wait,
    /// as tonic's `Endpoint::rate_limit`.
    pub fn rate_limit(mut self, limit: u64, duration: std::time::Duration) -> Self {
        self.rate = Some((limit.max(1), duration));
        self
    }

    /// Passed on over `http://`; an Ibex call has no HTTP/2 stream to reset.
    pub fn http2_max_concurrent_reset_streams(mut self, max: usize) -> Self {
        self.http2_reset.max_concurrent = Some(max);
        self
    }

    /// Passed on over `http://`; see [`Endpoint::http2_max_concurrent_reset_streams`].
    pub fn http2_reset_stream_duration(mut self, duration: std::time::Duration) -> Self {
        self.http2_reset.duration = Some(duration);
        self
    }

    /// Passed on over `http://`; see [`Endpoint::http2_max_concurrent_reset_streams`].
    pub fn http2_max_local_error_reset_streams(mut self, max: impl Into<Option<usize>>) -> Self {
        self.http2_reset.max_local_error = Some(max.into());
        self
    }

    /// The connect timeout, if one is set.
    pub fn get_connect_timeout(&self) -> Option<std::time::Duration> {
        self.settings.connect_timeout
    }

    /// The TCP keep-alive idle time, if one is set.
    pub fn get_tcp_keepalive(&self) -> Option<std::time::Duration> {
        self.tcp_keepalive.flatten()
    }

    /// Always true: Ibex's tcp connections set `TCP_NODELAY`, as tonic's default.
    pub fn get_tcp_nodelay(&self) -> bool {
        true
    }

    /// Response header lists accepted, in bytes (see [`Channel::with_max_header_list_size`]).
    pub fn max_header_list_size(mut self, bytes: usize) -> Self {
        self.max_header_list_size = bytes;
        self
    }

    /// Connects over TLS, as tonic's `Endpoint::tls_config`: on `tcp://` the handshake runs
    /// before the Ibex preface; on `http://`/`https://` stock tonic's TLS. shm ignores it;
    /// verbs refuses it. The settings are checked here.
    pub fn tls_config(mut self, tls: super::ClientTlsConfig) -> Result<Endpoint> {
        let transport = tls.transport()?;
        self.tls = Some((tls, transport));
        Ok(self)
    }

    fn transport_config(&self) -> Config {
        let mut c = match &self.config {
            Some(c) => c.clone(),
            None => Config::default(),
        };
        if let Some(k) = self.tcp_keepalive {
            c.tcp_keepalive = k;
        }
        if let Some(i) = self.keepalive_interval {
            c.keepalive = Some(i);
        }
        if let Some(t) = self.keepalive_timeout {
            c.keepalive_timeout = t;
        }
        if let Some(w) = self.connection_window {
            c.rndv_recv_budget = w as usize;
        }
        if let Some((t, transport)) = &self.tls {
            c.tls = Some(transport.clone());
            if let Some(d) = t.handshake_timeout() {
                c.handshake_timeout = d;
            }
        }
        c
    }

    fn tonic_endpoint(&self) -> Result<tonic::transport::Endpoint> {
        let mut ep = tonic::transport::Endpoint::from_shared(self.uri.clone())
            .map_err(|e| Error::Address {
                addr: self.uri.clone(),
                why: format!("not an http:// URI: {e}"),
            })?
            .tcp_nodelay(true);
        if let Some(t) = self.settings.connect_timeout {
            ep = ep.connect_timeout(t);
        }
        if let Some(t) = self.settings.timeout {
            ep = ep.timeout(t);
        }
        if let Some(n) = self.concurrency {
            ep = ep.concurrency_limit(n);
        }
        if let Some(k) = self.tcp_keepalive {
            ep = ep.tcp_keepalive(k);
        }
        if let Some(i) = self.keepalive_interval {
            ep = ep.http2_keep_alive_interval(i);
        }
        if let Some(t) = self.keepalive_timeout {
            ep = ep.keep_alive_timeout(t);
        }
        if let Some(ua) = &self.settings.user_agent {
            ep = ep.user_agent(ua.clone()).map_err(|e| Error::Address {
                addr: self.uri.clone(),
                why: format!("the user agent: {e}"),
            })?;
        }
        if let Some(o) = &self.origin {
            ep = ep.origin(o.clone());
        }
        if let Some((n, per)) = self.rate {
            ep = ep.rate_limit(n, per);
        }
        if let Some(m) = self.http2_reset.max_concurrent {
            ep = ep.http2_max_concurrent_reset_streams(m);
        }
        if let Some(d) = self.http2_reset.duration {
            ep = ep.http2_reset_stream_duration(d);
        }
        if let Some(m) = self.http2_reset.max_local_error {
            ep = ep.http2_max_local_error_reset_streams(m);
        }
        if let Some((t, _)) = &self.tls {
            ep = ep
                .tls_config(t.tonic()?)
                .map_err(|e| Error::Config(format!("TLS settings for HTTP/2: {e}")))?;
        }
        Ok(ep
            .initial_connection_window_size(self.connection_window)
            .initial_stream_window_size(self.stream_window)
            .buffer_size(self.buffer_size))
    }

    fn inner(&self) -> Inner {
        // Checked when the channel connects: a lazy channel's calls fail naming the problem.
        let config = self.transport_config();
        let limits = Limits {
            max_header_list_size: self.max_header_list_size,
        };
        let mut settings = self.settings.clone();
        settings.limit = self
            .concurrency
            .map(|n| Arc::new(tokio::sync::Semaphore::new(n)));
        settings.rate = self
            .rate
            .map(|(n, per)| Arc::new(super::client::RateLimit::new(n, per)));
        let target = Target {
            uri: self.uri.clone(),
            config,
        };
        Inner::new(None, Some(target), limits).with_settings(settings)
    }

    /// Connects now, as tonic's `Endpoint::connect`: the error says why not.
    pub async fn connect(&self) -> Result<Channel> {
        if is_http(&self.uri) {
            let ep = self.tonic_endpoint()?;
            let ch = ep.connect().await.map_err(|e| Error::Io {
                context: format!("connecting to the gRPC server at {} over HTTP/2", self.uri),
                source: std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    super::client::error_chain(&e),
                )
                .into(),
            })?;
            return Ok(Channel {
                kind: Kind::Http(ch),
            });
        }
        let config = self.transport_config();
        config.validate()?;
        let inner = self.inner();
        // The first connection goes through the same path as a reconnect (connect timeout).
        inner.connect_now().await?;
        Ok(Channel::from_inner(inner))
    }

    /// A channel that connects on its first call (and again after the connection is
    /// gone), as tonic's `Endpoint::connect_lazy`: nothing is checked until then, so a
    /// client can be made before its server is up. A setting the transport refuses fails
    /// each call, naming it.
    pub fn connect_lazy(&self) -> Channel {
        if is_http(&self.uri) {
            return match self.tonic_endpoint() {
                Ok(ep) => Channel {
                    kind: Kind::Http(ep.connect_lazy()),
                },
                // Not reached: the address was checked when the endpoint was made, and the
                // settings are tonic's own. Calls then fail naming the address.
                Err(_) => Channel::from_inner(self.inner()),
            };
        }
        Channel::from_inner(self.inner())
    }
}
