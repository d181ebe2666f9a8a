//! [`Endpoint`]: where a [`Channel`] connects and with which settings, in the shape of
//! tonic's `Endpoint`.

use std::sync::Arc;

use super::client::{Channel, Inner, Kind, Settings, Target};
use super::wire::Limits;
use crate::config::Config;
use crate::error::{Error, Result};

/// Channel settings that tonic users reach for, in the shape of tonic's `Endpoint`:
/// `Endpoint::new(uri).connect_timeout(..).timeout(..).concurrency_limit(..).connect()`.
/// The address may be an Ibex one or `http://` (stock HTTP/2, where tonic's own endpoint
/// applies the same settings).
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
    tls: Option<super::ClientTlsConfig>,
}

impl Endpoint {
    /// An endpoint for `uri` with no settings yet.
    pub fn new(uri: impl Into<String>) -> Endpoint {
        Endpoint {
            uri: uri.into(),
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
        }
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

    /// Response header lists accepted, in bytes (see [`Channel::with_max_header_list_size`]).
    pub fn max_header_list_size(mut self, bytes: usize) -> Self {
        self.max_header_list_size = bytes;
        self
    }

    /// Connects over TLS, as tonic's `Endpoint::tls_config`: on `tcp://` the handshake runs
    /// before the Ibex preface; on `http://`/`https://` stock tonic's TLS. shm ignores it;
    /// verbs refuses it. The settings are checked here.
    pub fn tls_config(mut self, tls: super::ClientTlsConfig) -> Result<Endpoint> {
        tls.transport()?;
        self.tls = Some(tls);
        Ok(self)
    }

    fn transport_config(&self) -> Result<Config> {
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
        if let Some(t) = &self.tls {
            c.tls = Some(t.transport()?);
            if let Some(d) = t.handshake_timeout() {
                c.handshake_timeout = d;
            }
        }
        Ok(c)
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
        if let Some(t) = &self.tls {
            ep = ep
                .tls_config(t.tonic()?)
                .map_err(|e| Error::Config(format!("TLS settings for HTTP/2: {e}")))?;
        }
        Ok(ep
            .initial_connection_window_size(self.connection_window)
            .initial_stream_window_size(self.stream_window)
            .buffer_size(self.buffer_size))
    }

    fn inner(&self) -> Result<Inner> {
        let config = self.transport_config()?;
        config.validate()?;
        crate::conn::Addr::parse(&self.uri)?;
        let limits = Limits {
            max_header_list_size: self.max_header_list_size,
        };
        let mut settings = self.settings.clone();
        settings.limit = self
            .concurrency
            .map(|n| Arc::new(tokio::sync::Semaphore::new(n)));
        let target = Target {
            uri: self.uri.clone(),
            config,
        };
        Ok(Inner::new(None, Some(target), limits).with_settings(settings))
    }

    /// Connects now.
    pub async fn connect(self) -> Result<Channel> {
        if is_http(&self.uri) {
            let ep = self.tonic_endpoint()?;
            let ch = ep.connect().await.map_err(|e| Error::Io {
                context: format!("connecting to the gRPC server at {} over HTTP/2", self.uri),
                source: std::io::Error::new(std::io::ErrorKind::ConnectionRefused, e.to_string())
                    .into(),
            })?;
            return Ok(Channel {
                kind: Kind::Http(ch),
            });
        }
        let inner = self.inner()?;
        // The first connection goes through the same path as a reconnect (connect timeout).
        inner.connect_now().await?;
        Ok(Channel::from_inner(inner))
    }

    /// Connects on the first call, as tonic's `Endpoint::connect_lazy`.
    pub fn connect_lazy(self) -> Result<Channel> {
        if is_http(&self.uri) {
            return Ok(Channel {
                kind: Kind::Http(self.tonic_endpoint()?.connect_lazy()),
            });
        }
        Ok(Channel::from_inner(self.inner()?))
    }
}

/// Stock HTTP/2 addresses, which tonic's own channel serves.
fn is_http(uri: &str) -> bool {
    uri.starts_with("http://") || uri.starts_with("https://")
}
