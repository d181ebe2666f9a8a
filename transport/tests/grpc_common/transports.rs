//! The transports the conformance cases run over. Each gives a server fed with the cases'
//! [`Services`] and a client channel boxed to one type ([`Chan`]), so the cases are written
//! once.

use std::future::Future;

use ibex_proto::bench::v1::Payload;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::service::Routes;
use tonic::{Code, Request, Status};
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

/// The services a case serves, in both forms a server takes them: stock tonic gets
/// [`Routes`], Ibex gets each service through `Builder::add_service`, as users write it
/// (Ibex calls those without tonic's router; `Routes` go through it).
pub struct Services {
    routes: Routes,
    add: Box<dyn FnOnce(ibex_transport::grpc::Builder) -> ibex_transport::grpc::Builder + Send>,
}

impl Services {
    /// The test service as ibex-codegen generates it: stock tonic serves tonic's server
    /// for it, Ibex registers its unary methods as direct handlers.
    pub fn new(svc: ibex_proto::bench::v1::bench_ibex::BenchServer<super::BenchImpl>) -> Services {
        Services {
            routes: Routes::new(svc.clone().into_tonic()),
            add: Box::new(move |b| b.add_service(svc)),
        }
    }

    /// Any tower service (tonic's generated server, one behind an interceptor or a layer):
    /// every call goes through it on Ibex too.
    pub fn tower<S>(svc: S) -> Services
    where
        S: tower::Service<http::Request<tonic::body::Body>, Error = std::convert::Infallible>
            + tonic::server::NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        Services {
            routes: Routes::new(svc.clone()),
            add: Box::new(move |b| b.add_service(svc)),
        }
    }

    /// The same services on an Ibex server with `settings` applied to its builder (a call
    /// limit, say); stock tonic servers ignore them.
    pub fn with_builder(
        self,
        settings: impl FnOnce(ibex_transport::grpc::Builder) -> ibex_transport::grpc::Builder
        + Send
        + 'static,
    ) -> Services {
        let add = self.add;
        Services {
            routes: self.routes,
            add: Box::new(move |b| add(settings(b))),
        }
    }

    /// Served through tonic's router on Ibex too (`Builder::add_routes`).
    pub fn routes(routes: Routes) -> Services {
        Services {
            routes: routes.clone(),
            add: Box::new(move |b| b.add_routes(routes)),
        }
    }
}

/// Errors as tonic's client machinery accepts them.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A client channel of any transport.
pub type Chan = BoxCloneSyncService<
    http::Request<tonic::body::Body>,
    http::Response<tonic::body::Body>,
    ChanError,
>;

/// A transport's channel error behind one concrete type. (A bare `BoxError` as the service
/// error trips a higher-ranked `From` bound inside spawned tasks.) tonic looks for a
/// `Status` or a connect error along `source()`, so the inner error stays reachable there.
#[derive(Debug)]
pub struct ChanError(pub BoxError);

impl std::fmt::Display for ChanError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ChanError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// A running server.
pub struct ServerHandle {
    /// Where clients connect (the transport's own address syntax).
    pub addr: String,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), String>>,
}

impl ServerHandle {
    /// Wraps a spawned server task that stops (gracefully) when the sender fires.
    pub fn new(
        addr: String,
        shutdown: oneshot::Sender<()>,
        task: JoinHandle<Result<(), String>>,
    ) -> Self {
        ServerHandle {
            addr,
            shutdown: Some(shutdown),
            task,
        }
    }

    /// Asks the server to stop accepting and drain.
    pub fn trigger_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Waits for the server to finish; its result.
    pub async fn join(self) -> Result<(), String> {
        self.task
            .await
            .map_err(|e| format!("server task panicked: {e}"))?
    }

    /// Graceful shutdown, then join.
    pub async fn shutdown(mut self) -> Result<(), String> {
        self.trigger_shutdown();
        self.join().await
    }
}

/// One way of carrying gRPC calls.
pub trait Transport {
    /// The code a client sees when its deadline passes while the handler is still running.
    const DEADLINE_CODE: Code;
    /// What the first call after the server went away may fail with (after that, every
    /// transport says `Unavailable`).
    const GONE_CODES: &'static [Code];
    /// The server runs its connections on Ibex's serve threads (`Config::serve_threads`).
    const HOMED: bool = false;
    /// Starts a server for `routes` on a fresh address.
    fn serve(services: Services) -> impl Future<Output = ServerHandle> + Send;
    /// Starts a server again at the address of an earlier one (its `ServerHandle::addr`):
    /// a restarted server, as clients see it.
    fn serve_at(addr: &str, services: Services) -> impl Future<Output = ServerHandle> + Send;
    /// A client channel to `addr`.
    fn connect(addr: &str) -> impl Future<Output = Result<Chan, String>> + Send;
    /// An address nobody serves.
    fn dead_addr() -> impl Future<Output = String> + Send;
}

/// The error and its whole source chain, for assertions on messages.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Stock tonic: HTTP/2 over TCP on 127.0.0.1, the reference behaviour.
pub struct Stock;

impl Transport for Stock {
    // tonic's client maps its own `grpc-timeout` timer to `Cancelled("Timeout expired")`;
    // see docs/grpc.md.
    const DEADLINE_CODE: Code = Code::Cancelled;
    // hyper may still hand the call to the closing connection: `Cancelled("operation was
    // canceled", connection closed)`.
    const GONE_CODES: &'static [Code] = &[Code::Unavailable, Code::Cancelled];

    async fn serve(services: Services) -> ServerHandle {
        Self::serve_at("127.0.0.1:0", services).await
    }

    async fn serve_at(addr: &str, services: Services) -> ServerHandle {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_routes(services.routes)
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener),
                    async {
                        let _ = rx.await;
                    },
                )
                .await
                .map_err(|e| chain(&e))
        });
        ServerHandle::new(addr, tx, task)
    }

    async fn connect(addr: &str) -> Result<Chan, String> {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| chain(&e))?
            .connect()
            .await
            .map_err(|e| chain(&e))?;
        Ok(Chan::new(ch.map_err(|e| ChanError(e.into()))))
    }

    async fn dead_addr() -> String {
        format!("127.0.0.1:{}", ibex_test_support::free_port())
    }
}

/// Ibex's test configuration: a fixed eager threshold and fragment size, so no connect-time
/// probe.
pub fn ibex_config() -> ibex_transport::Config {
    let c = ibex_transport::Config::from_env()
        // The environment's timeouts (the Soft-RoCE VM raises the set-up deadline, since
        // emulated verbs set-up takes seconds); a bad value fails loudly.
        .expect("IBEX_* environment variables");
    ibex_transport::Config {
        eager_threshold: Some(16 * 1024),
        fragment_size: Some(c.default_fragment_size),
        ..c
    }
}

pub async fn ibex_serve(uri: String, services: Services) -> ServerHandle {
    ibex_serve_with(uri, services, ibex_config()).await
}

async fn ibex_serve_with(
    uri: String,
    services: Services,
    config: ibex_transport::Config,
) -> ServerHandle {
    ibex_serve_stats(uri, services, config).await.0
}

/// [`ibex_serve`], with a handle on the server's counters.
pub async fn ibex_serve_stats(
    uri: String,
    services: Services,
    config: ibex_transport::Config,
) -> (ServerHandle, ibex_transport::grpc::ServerStats) {
    let listener = ibex_transport::listen(&uri, config).await.unwrap();
    let addr = listener.local_uri();
    let builder = (services.add)(ibex_transport::grpc::Server::builder());
    let stats = builder.stats();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        builder
            .serve_with_listener(listener, async {
                let _ = rx.await;
            })
            .await
            .map_err(|e| chain(&e))
    });
    (ServerHandle::new(addr, tx, task), stats)
}

async fn ibex_connect(addr: &str) -> Result<Chan, String> {
    ibex_connect_with(addr, ibex_config()).await
}

/// An Ibex channel as the cases' one client type.
fn boxed(ch: ibex_transport::grpc::Channel) -> Chan {
    let ch = ServiceExt::<http::Request<tonic::body::Body>>::map_response(ch, |r| {
        r.map(tonic::body::Body::new)
    });
    let ch =
        ServiceExt::<http::Request<tonic::body::Body>>::map_err(ch, |s| ChanError(Box::new(s)));
    Chan::new(ch)
}

async fn ibex_connect_with(addr: &str, config: ibex_transport::Config) -> Result<Chan, String> {
    let ch = ibex_transport::grpc::Channel::connect_with_config(addr, config)
        .await
        .map_err(|e| chain(&e))?;
    Ok(boxed(ch))
}

/// A socket path unique to this process and call.
pub fn shm_uri() -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!(
        "shm://{}/ibex-grpc-{}-{n}.sock",
        std::env::temp_dir().display(),
        std::process::id()
    )
}

/// gRPC over Ibex, shared-memory provider.
pub struct IbexShm;

impl Transport for IbexShm {
    const DEADLINE_CODE: Code = Code::DeadlineExceeded;
    const GONE_CODES: &'static [Code] = &[Code::Unavailable];

    async fn serve(services: Services) -> ServerHandle {
        ibex_serve(shm_uri(), services).await
    }

    async fn serve_at(addr: &str, services: Services) -> ServerHandle {
        ibex_serve(addr.to_string(), services).await
    }

    async fn connect(addr: &str) -> Result<Chan, String> {
        ibex_connect(addr).await
    }

    async fn dead_addr() -> String {
        shm_uri()
    }
}

/// gRPC over Ibex, shared-memory provider, the server on two threads of its own
/// (`Config::serve_threads`): each connection's tasks and handlers on a single-thread runtime.
pub struct IbexShmHomes;

fn homes_config() -> ibex_transport::Config {
    ibex_transport::Config {
        serve_threads: 2,
        ..ibex_config()
    }
}

impl Transport for IbexShmHomes {
    const HOMED: bool = true;
    const DEADLINE_CODE: Code = Code::DeadlineExceeded;
    const GONE_CODES: &'static [Code] = &[Code::Unavailable];

    async fn serve(services: Services) -> ServerHandle {
        ibex_serve_with(shm_uri(), services, homes_config()).await
    }

    async fn serve_at(addr: &str, services: Services) -> ServerHandle {
        ibex_serve_with(addr.to_string(), services, homes_config()).await
    }

    async fn connect(addr: &str) -> Result<Chan, String> {
        ibex_connect(addr).await
    }

    async fn dead_addr() -> String {
        shm_uri()
    }
}

/// gRPC over Ibex, tcp provider.
pub struct IbexTcp;

impl Transport for IbexTcp {
    const DEADLINE_CODE: Code = Code::DeadlineExceeded;
    const GONE_CODES: &'static [Code] = &[Code::Unavailable];

    async fn serve(services: Services) -> ServerHandle {
        ibex_serve("tcp://127.0.0.1:0".into(), services).await
    }

    async fn serve_at(addr: &str, services: Services) -> ServerHandle {
        ibex_serve(addr.to_string(), services).await
    }

    async fn connect(addr: &str) -> Result<Chan, String> {
        ibex_connect(addr).await
    }

    async fn dead_addr() -> String {
        format!("tcp://{}", Stock::dead_addr().await)
    }
}

/// The `pull` mode of the test service: the request's one buffer is a descriptor of memory
/// the client exposed, `x-pull-len` its length; the handler reads it through the peer handle
/// and echoes the data, and says in `x-one-sided` whether the read was one-sided.
pub async fn pull(req: &Request<Payload>) -> Result<(Payload, bool), Status> {
    let peer = req
        .extensions()
        .get::<ibex_transport::grpc::PeerHandle>()
        .ok_or_else(|| {
            Status::failed_precondition("no PeerHandle: this transport cannot read client memory")
        })?;
    let len: usize = req
        .metadata()
        .get("x-pull-len")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .ok_or_else(|| Status::invalid_argument("x-pull-len missing"))?;
    let desc = req
        .get_ref()
        .buffers
        .first()
        .cloned()
        .ok_or_else(|| Status::invalid_argument("no descriptor"))?;
    let got = peer
        .read_remote(desc, ibex_transport::link::RecvBuf::heap(len))
        .await
        .map_err(|e| Status::internal(format!("read_remote failed: {e}")))?;
    Ok((
        Payload {
            buffers: vec![got.into_bytes()],
        },
        peer.one_sided(),
    ))
}

/// gRPC over Ibex, verbs provider: only in the Soft-RoCE VM (`scripts/verbs-test.sh`), which
/// names the listen address and each side's device.
#[cfg(feature = "verbs")]
pub struct IbexVerbs;

#[cfg(feature = "verbs")]
fn verbs_config(var: &str) -> ibex_transport::Config {
    ibex_transport::Config {
        rdma_device: std::env::var(var).ok(),
        ..ibex_config()
    }
}

#[cfg(feature = "verbs")]
impl Transport for IbexVerbs {
    const DEADLINE_CODE: Code = Code::DeadlineExceeded;
    const GONE_CODES: &'static [Code] = &[Code::Unavailable];

    async fn serve(services: Services) -> ServerHandle {
        let at = std::env::var("IBEX_TEST_LISTEN_ADDR").unwrap_or_else(|_| "127.0.0.1:0".into());
        ibex_serve_with(
            format!("verbs://{at}"),
            services,
            verbs_config("IBEX_TEST_SERVER_DEV"),
        )
        .await
    }

    async fn serve_at(addr: &str, services: Services) -> ServerHandle {
        ibex_serve_with(
            addr.to_string(),
            services,
            verbs_config("IBEX_TEST_SERVER_DEV"),
        )
        .await
    }

    async fn connect(addr: &str) -> Result<Chan, String> {
        ibex_connect_with(addr, verbs_config("IBEX_TEST_CLIENT_DEV")).await
    }

    async fn dead_addr() -> String {
        format!("verbs://{}", Stock::dead_addr().await)
    }
}

/// The test certificates (`tests/data/tls`).
pub fn tls_file(name: &str) -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/tls/{name}")),
    )
    .unwrap()
}

/// The server's TLS settings, with tonic's names; clients must present a certificate of
/// the test CA when `mutual`.
pub fn server_tls(mutual: bool) -> ibex_transport::grpc::ServerTlsConfig {
    use ibex_transport::grpc::{Certificate, Identity, ServerTlsConfig};
    let t = ServerTlsConfig::new().identity(Identity::from_pem(
        tls_file("server.pem"),
        tls_file("server.key"),
    ));
    if mutual {
        t.client_ca_root(Certificate::from_pem(tls_file("ca.pem")))
    } else {
        t
    }
}

/// The client's TLS settings, with tonic's names; with the client certificate when `mutual`.
pub fn client_tls(mutual: bool) -> ibex_transport::grpc::ClientTlsConfig {
    use ibex_transport::grpc::{Certificate, ClientTlsConfig, Identity};
    let t = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(tls_file("ca.pem")));
    if mutual {
        t.identity(Identity::from_pem(
            tls_file("client.pem"),
            tls_file("client.key"),
        ))
    } else {
        t
    }
}

/// Serves through `Builder::tls_config` and `serve_any` at `uri` (a `tcp://` or `https://`
/// address whose port is free), once it accepts connections.
pub async fn tls_serve_any(uri: String, services: Services, mutual: bool) -> ServerHandle {
    let builder = (services.add)(ibex_transport::grpc::Server::builder().config(ibex_config()))
        .tls_config(server_tls(mutual))
        .unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let at = uri.clone();
    let task = tokio::spawn(async move {
        builder
            .serve_any(&at, async {
                let _ = rx.await;
            })
            .await
            .map_err(|e| chain(&e))
    });
    let host_port = uri.split("://").nth(1).unwrap().to_string();
    for _ in 0..500 {
        if tokio::net::TcpStream::connect(&host_port).await.is_ok() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    ServerHandle::new(uri, tx, task)
}

/// Connects through `Endpoint::tls_config`.
pub async fn tls_connect(addr: &str, mutual: bool) -> Result<Chan, String> {
    let ch = ibex_transport::grpc::Endpoint::new(addr)
        .map_err(|e| chain(&e))?
        .config(ibex_config())
        .tls_config(client_tls(mutual))
        .map_err(|e| chain(&e))?
        .connect()
        .await
        .map_err(|e| chain(&e))?;
    Ok(boxed(ch))
}

/// Connects through `Channel::connect_any` with the client TLS setting in the transport
/// configuration (`Config::tls`): Ibex tcp for `tcp://`, stock HTTP/2 for `https://`.
pub async fn tls_connect_any(addr: &str, mutual: bool) -> Result<Chan, String> {
    let mut config = ibex_config();
    config.tls = Some(client_tls(mutual).transport().map_err(|e| chain(&e))?);
    let ch = ibex_transport::grpc::Channel::connect_any(addr, config)
        .await
        .map_err(|e| chain(&e))?;
    Ok(boxed(ch))
}

/// gRPC over Ibex, tcp provider with TLS, through `serve_any` and `connect_any`.
pub struct IbexTcpTls;

impl Transport for IbexTcpTls {
    const DEADLINE_CODE: Code = Code::DeadlineExceeded;
    const GONE_CODES: &'static [Code] = &[Code::Unavailable];

    async fn serve(services: Services) -> ServerHandle {
        let port = ibex_test_support::free_port();
        tls_serve_any(format!("tcp://127.0.0.1:{port}"), services, false).await
    }

    async fn serve_at(addr: &str, services: Services) -> ServerHandle {
        tls_serve_any(addr.to_string(), services, false).await
    }

    async fn connect(addr: &str) -> Result<Chan, String> {
        tls_connect_any(addr, false).await
    }

    async fn dead_addr() -> String {
        format!("tcp://{}", Stock::dead_addr().await)
    }
}

/// Stock tonic's HTTP/2 with TLS (`https://`), through the same `serve_any` and
/// `connect_any`.
pub struct TonicTls;

impl Transport for TonicTls {
    const DEADLINE_CODE: Code = Code::Cancelled;
    const GONE_CODES: &'static [Code] = &[Code::Unavailable, Code::Cancelled];

    async fn serve(services: Services) -> ServerHandle {
        let port = ibex_test_support::free_port();
        tls_serve_any(format!("https://127.0.0.1:{port}"), services, false).await
    }

    async fn serve_at(addr: &str, services: Services) -> ServerHandle {
        tls_serve_any(addr.to_string(), services, false).await
    }

    async fn connect(addr: &str) -> Result<Chan, String> {
        tls_connect_any(addr, false).await
    }

    async fn dead_addr() -> String {
        format!("https://{}", Stock::dead_addr().await)
    }
}
