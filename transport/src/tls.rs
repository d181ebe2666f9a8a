//! TLS for the tcp provider, with rustls.
//!
//! The handshake runs right after the TCP connect or accept and before the Ibex preface,
//! so the preface (and with it [`Config::auth_token`](crate::Config::auth_token)) and
//! every record after it travel encrypted. After the handshake the tcp link drives the
//! rustls session itself, without an async wrapper: plaintext goes through the session's
//! writer and the socket is written with non-blocking writes, and received records are
//! decrypted into the record buffer or straight into a read's destination.
//!
//! shm needs no TLS (the peer is on this host, and the kernel's credentials of its socket
//! are checked): a TLS setting is ignored there. verbs does not take it: RDMA payloads
//! move between registered buffers by the NICs and cannot pass through TLS, so a
//! `verbs://` address with a TLS setting is an error.
//!
//! ```no_run
//! # fn demo(server: std::sync::Arc<rustls::ServerConfig>, client: std::sync::Arc<rustls::ClientConfig>) {
//! use ibex_transport::{Config, tls::Tls};
//! let server_config = Config { tls: Some(Tls::server(server)), ..Config::default() };
//! let client_config = Config {
//!     tls: Some(Tls::client(client).server_name("ps0.example.com")),
//!     ..Config::default()
//! };
//! # }
//! ```

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::error::{Error, Result};
use crate::preface::{self, Preface, Provider};

pub use rustls;

/// A TLS setting for the tcp provider ([`Config::tls`](crate::Config::tls)): the server's
/// or the client's rustls configuration.
#[derive(Clone)]
pub enum Tls {
    /// A listener's side: its certificate and key, and whether and how it checks clients.
    Server(Arc<rustls::ServerConfig>),
    /// A connecting side: the roots it trusts (and its own certificate for mutual TLS), and
    /// the name the server's certificate must hold.
    Client {
        /// The rustls client configuration.
        config: Arc<rustls::ClientConfig>,
        /// The name to verify the server's certificate against; `None`: the host part of
        /// the address connected to.
        server_name: Option<String>,
    },
}

impl Tls {
    /// A listener's TLS setting.
    pub fn server(config: Arc<rustls::ServerConfig>) -> Tls {
        Tls::Server(config)
    }

    /// A connecting side's TLS setting; the server's certificate is checked against the
    /// host part of the address unless [`Tls::server_name`] names another.
    pub fn client(config: Arc<rustls::ClientConfig>) -> Tls {
        Tls::Client {
            config,
            server_name: None,
        }
    }

    /// The name the server's certificate must hold (a client setting; a server's ignores
    /// it).
    pub fn server_name(self, name: impl Into<String>) -> Tls {
        match self {
            Tls::Client { config, .. } => Tls::Client {
                config,
                server_name: Some(name.into()),
            },
            other => other,
        }
    }
}

// By hand: the configurations hold private keys, which must never reach a log.
impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tls::Server(c) => f
                .debug_struct("Tls::Server")
                .field("alpn_protocols", &c.alpn_protocols.len())
                .finish_non_exhaustive(),
            Tls::Client { server_name, .. } => f
                .debug_struct("Tls::Client")
                .field("server_name", server_name)
                .finish_non_exhaustive(),
        }
    }
}

/// What a TLS connection learned of its peer, carried by the link's
/// [`LinkInfo`](crate::link::LinkInfo).
#[derive(Clone, Debug, Default)]
pub struct TlsPeer {
    /// The certificate chain the peer presented, its own first; `None` when it presented
    /// none (a client where client certificates are optional).
    pub peer_certs: Option<Arc<Vec<CertificateDer<'static>>>>,
    /// tonic's view of the same, for a gRPC server's requests.
    #[cfg(feature = "grpc")]
    pub(crate) connect_info:
        Option<tonic::transport::server::TlsConnectInfo<tonic::transport::server::TcpConnectInfo>>,
}

/// A rustls session after its handshake, for the link to drive.
pub(crate) struct Session {
    pub(crate) conn: rustls::Connection,
    pub(crate) peer: TlsPeer,
}

/// Which end of the connection this side is.
pub(crate) enum Role<'a> {
    /// Connecting to `host` (the address's host part).
    Client {
        host: &'a str,
    },
    Server,
}

/// The first byte of a TLS record carrying a handshake message (a ClientHello).
const TLS_HANDSHAKE: u8 = 0x16;

/// Whether `b`, the start of what a peer sent, looks like a TLS ClientHello.
pub(crate) fn looks_like_tls(b: &[u8]) -> bool {
    b.len() >= 2 && b[0] == TLS_HANDSHAKE && b[1] == 0x03
}

/// The first byte of a TLS alert record.
const TLS_ALERT: u8 = 0x15;

/// Whether `b` looks like a TLS alert record (what a TLS listener answers a plaintext
/// preface with before it closes).
pub(crate) fn looks_like_alert(b: &[u8]) -> bool {
    b.len() >= 2 && b[0] == TLS_ALERT && b[1] == 0x03
}

/// A fatal `protocol_version` alert, in a TLS 1.2 record: what a plaintext client gets
/// before the close, so that it can say the server requires TLS.
const PLAIN_REFUSED_ALERT: [u8; 7] = [TLS_ALERT, 0x03, 0x03, 0x00, 0x02, 0x02, 70];

/// Runs the TLS handshake on a fresh stream and then the Ibex preface exchange inside the
/// encrypted stream, and hands the session over for the link to drive. No deadline of its
/// own: callers bound it.
pub(crate) async fn handshake(
    stream: TcpStream,
    tls: &Tls,
    role: Role<'_>,
    peer: &str,
    ours: &Preface,
) -> Result<(TcpStream, Session, Preface)> {
    let who = format!("peer at {peer}");
    let then = async |io: &mut Explained<'_>| -> Result<Preface> {
        preface::exchange(io, Provider::Tcp, ours, &who)
            .await?
            .ok_or_else(|| preface::closed_during_setup(&who))
    };
    match (tls, role) {
        (Tls::Server(config), Role::Server) => {
            refuse_plain_client(&stream, peer).await?;
            let acceptor = tokio_rustls::TlsAcceptor::from(config.clone());
            let mut s = acceptor
                .accept(stream)
                .await
                .map_err(|e| explain(e, Side::Server, peer))?;
            #[cfg(feature = "grpc")]
            let connect_info = Some(tonic::transport::server::Connected::connect_info(&s));
            let out = {
                let mut io = Explained {
                    inner: Inner::Server(&mut s),
                    side: Side::Server,
                };
                then(&mut io).await.map_err(|e| reexplain(e, Side::Server, peer))?
            };
            let (tcp, conn) = s.into_inner();
            let session = Session::new(conn.into());
            #[cfg(feature = "grpc")]
            let session = Session {
                peer: TlsPeer {
                    connect_info,
                    ..session.peer
                },
                ..session
            };
            Ok((tcp, session, out))
        }
        (
            Tls::Client {
                config,
                server_name,
            },
            Role::Client { host },
        ) => {
            let name = server_name.as_deref().unwrap_or(host);
            // An IPv6 literal comes bracketed in an address.
            let bare = name.trim_start_matches('[').trim_end_matches(']');
            let name = ServerName::try_from(bare.to_string()).map_err(|e| {
                Error::Config(format!(
                    "{name:?} is no server name TLS can check ({e}); set the name the server's certificate holds (Tls::server_name, ClientTlsConfig::domain_name)"
                ))
            })?;
            let connector = tokio_rustls::TlsConnector::from(config.clone());
            let mut s = connector
                .connect(name, stream)
                .await
                .map_err(|e| explain(e, Side::Client, peer))?;
            let out = {
                let mut io = Explained {
                    inner: Inner::Client(&mut s),
                    side: Side::Client,
                };
                then(&mut io).await.map_err(|e| reexplain(e, Side::Client, peer))?
            };
            let (tcp, conn) = s.into_inner();
            Ok((tcp, Session::new(conn.into()), out))
        }
        (Tls::Client { .. }, Role::Server) => Err(Error::Config(
            "Config::tls holds a client setting (Tls::client) on a listener; a listener needs Tls::server with its certificate and key".into(),
        )),
        (Tls::Server(_), Role::Client { .. }) => Err(Error::Config(
            "Config::tls holds a server setting (Tls::server) on a connecting side; a client needs Tls::client with the roots it trusts".into(),
        )),
    }
}

impl Session {
    /// The session of a finished handshake, with the certificates the peer presented.
    fn new(conn: rustls::Connection) -> Session {
        let peer_certs = conn
            .peer_certificates()
            .map(|c| Arc::new(c.iter().map(|c| c.clone().into_owned()).collect()));
        Session {
            conn,
            peer: TlsPeer {
                peer_certs,
                #[cfg(feature = "grpc")]
                connect_info: None,
            },
        }
    }
}

/// A listener that requires TLS sees what the peer opened with before the handshake: a
/// plaintext Ibex preface gets an error that says so rather than rustls' "corrupt
/// message".
async fn refuse_plain_client(stream: &TcpStream, peer: &str) -> Result<()> {
    let mut b = [0u8; 4];
    let n = stream
        .peek(&mut b)
        .await
        .map_err(|e| Error::io(format!("reading the TLS ClientHello of {peer}"), e))?;
    if n > 0 && b[0] == b'I' {
        // Take what the client sent (its preface) so that the close is a FIN, not a reset
        // that could discard the alert; then the alert, on a fresh socket whose send
        // buffer is empty. Best effort, and neither waits.
        let mut sink = [0u8; 4096];
        let _ = stream.try_read(&mut sink);
        let _ = stream.try_write(&PLAIN_REFUSED_ALERT);
        return Err(Error::Handshake(format!(
            "the peer at {peer} speaks plain Ibex tcp but this listener requires TLS; configure the client with tls (Config::tls = Tls::client, or Endpoint::tls_config)"
        )));
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Client,
    Server,
}

/// The rustls error inside an I/O error, where there is one.
fn rustls_error(e: &io::Error) -> Option<&rustls::Error> {
    e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>())
}

/// A handshake failure as an [`Error`] that names the problem and the fix.
fn explain(e: io::Error, side: Side, peer: &str) -> Error {
    match rustls_error(&e) {
        Some(r) => Error::Handshake(describe(r, side, peer)),
        None if e.kind() == io::ErrorKind::UnexpectedEof => Error::Handshake(match side {
            Side::Client => format!(
                "the server at {peer} closed the connection during the TLS handshake: it does not speak TLS, or it refused this client (see its log)"
            ),
            Side::Server => format!(
                "the peer at {peer} closed the connection during the TLS handshake: it may not trust this server's certificate (see its log)"
            ),
        }),
        None => Error::io(format!("TLS handshake with {peer}"), e),
    }
}

/// A failure inside the encrypted stream (the preface) that rustls caused, as
/// [`explain`] would put it; other errors pass as they are.
fn reexplain(e: Error, side: Side, peer: &str) -> Error {
    match &e {
        Error::Io { source, .. } => match rustls_error(source) {
            Some(r) => Error::Handshake(describe(r, side, peer)),
            None => e,
        },
        _ => e,
    }
}

fn describe(e: &rustls::Error, side: Side, peer: &str) -> String {
    use rustls::{AlertDescription as A, CertificateError as C, Error as E};
    let whose = match side {
        Side::Client => format!("the certificate of the server at {peer}"),
        Side::Server => format!("the client certificate of the peer at {peer}"),
    };
    let trust_fix = match side {
        Side::Client => {
            "give the client the CA that signed it (ClientTlsConfig::ca_certificate, or the roots of its rustls ClientConfig)"
        }
        Side::Server => {
            "give the server the CA that signed it (ServerTlsConfig::client_ca_root, or the client verifier of its rustls ServerConfig)"
        }
    };
    match (e, side) {
        (E::InvalidCertificate(C::UnknownIssuer), _) => {
            format!(
                "{whose} is signed by a CA this side does not trust (unknown issuer): {trust_fix}"
            )
        }
        (E::InvalidCertificate(C::NotValidForName | C::NotValidForNameContext { .. }), _) => {
            format!(
                "{whose} is not valid for the name this client asked for (name mismatch: {e}): connect with a name the certificate holds (ClientTlsConfig::domain_name, Tls::server_name) or reissue the certificate for this name"
            )
        }
        (E::InvalidCertificate(C::Expired | C::ExpiredContext { .. }), _) => {
            format!("{whose} has expired ({e}): renew it")
        }
        (E::InvalidCertificate(C::NotValidYet | C::NotValidYetContext { .. }), _) => {
            format!("{whose} is not valid yet ({e}): check the clocks of both hosts")
        }
        (E::InvalidCertificate(other), _) => format!("{whose} was refused: {other:?}"),
        (E::NoCertificatesPresented, Side::Server) => format!(
            "the peer at {peer} sent no client certificate, and this server requires one: configure the client with an identity (ClientTlsConfig::identity), or make client certificates optional (ServerTlsConfig::client_auth_optional)"
        ),
        (E::AlertReceived(A::CertificateRequired | A::HandshakeFailure), Side::Client) => {
            format!(
                "the server at {peer} requires a client certificate, and this client sent none it accepts: configure the client with an identity (ClientTlsConfig::identity) signed by a CA the server trusts"
            )
        }
        (E::AlertReceived(A::UnknownCA | A::BadCertificate), Side::Client) => format!(
            "the server at {peer} refused this client's certificate ({e}): use a certificate signed by a CA the server trusts (its ServerTlsConfig::client_ca_root)"
        ),
        (E::AlertReceived(A::UnknownCA | A::BadCertificate), Side::Server) => format!(
            "the peer at {peer} refused this server's certificate ({e}): give the client the CA that signed it"
        ),
        (E::InvalidMessage(_) | E::InappropriateMessage { .. }, Side::Client) => format!(
            "the server at {peer} does not speak TLS (it answered the ClientHello with something else, likely a plain Ibex tcp preface): connect without tls, or configure the server with tls"
        ),
        (E::InvalidMessage(_) | E::InappropriateMessage { .. }, Side::Server) => format!(
            "the peer at {peer} does not speak TLS ({e}); this listener requires TLS: configure the client with tls"
        ),
        (other, _) => format!("TLS with {peer} failed: {other}"),
    }
}

/// The TLS stream during set-up, turning rustls' errors into I/O errors whose text names
/// the problem.
pub(crate) struct Explained<'a> {
    inner: Inner<'a>,
    side: Side,
}

enum Inner<'a> {
    Client(&'a mut tokio_rustls::client::TlsStream<TcpStream>),
    Server(&'a mut tokio_rustls::server::TlsStream<TcpStream>),
}

impl Explained<'_> {
    fn fix(&self, e: io::Error) -> io::Error {
        match rustls_error(&e) {
            // Kept as the source, so that `reexplain` finds it.
            Some(_) => e,
            None if self.side == Side::Client && e.kind() == io::ErrorKind::UnexpectedEof => {
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the TLS connection during set-up",
                )
            }
            None => e,
        }
    }
}

impl AsyncRead for Explained<'_> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = match &mut this.inner {
            Inner::Client(s) => Pin::new(&mut **s).poll_read(cx, buf),
            Inner::Server(s) => Pin::new(&mut **s).poll_read(cx, buf),
        };
        r.map_err(|e| this.fix(e))
    }
}

impl AsyncWrite for Explained<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = match &mut this.inner {
            Inner::Client(s) => Pin::new(&mut **s).poll_write(cx, buf),
            Inner::Server(s) => Pin::new(&mut **s).poll_write(cx, buf),
        };
        r.map_err(|e| this.fix(e))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = match &mut this.inner {
            Inner::Client(s) => Pin::new(&mut **s).poll_flush(cx),
            Inner::Server(s) => Pin::new(&mut **s).poll_flush(cx),
        };
        r.map_err(|e| this.fix(e))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = match &mut this.inner {
            Inner::Client(s) => Pin::new(&mut **s).poll_shutdown(cx),
            Inner::Server(s) => Pin::new(&mut **s).poll_shutdown(cx),
        };
        r.map_err(|e| this.fix(e))
    }
}

/// Refuses a TLS setting on a `verbs://` address: RDMA moves payloads between registered
/// buffers without the CPU, so they cannot pass through TLS.
pub(crate) fn refuse_on_verbs(uri: &str) -> Error {
    Error::Config(format!(
        "{uri}: Config::tls is set, but verbs traffic is not encrypted (RDMA moves payloads between registered buffers without the CPU); use a tcp:// address for TLS, or unset tls for verbs"
    ))
}
