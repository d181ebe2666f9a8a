//! TLS settings with tonic's names: [`Identity`], [`Certificate`], [`ServerTlsConfig`] and
//! [`ClientTlsConfig`], for [`Builder::tls_config`](super::Builder::tls_config) and
//! [`Endpoint::tls_config`](super::Endpoint::tls_config). Over `tcp://` they become the
//! rustls settings of the tcp provider ([`crate::tls`]); over `http://`/`https://` they go
//! to stock tonic as its own TLS settings, so one program serves both.

use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, TrustAnchor};

use crate::error::{Error, Result};
use crate::tls::Tls;

/// A PEM-encoded X.509 certificate, as tonic's.
pub use tonic::transport::Certificate;

/// A certificate chain and its private key, both PEM, as tonic's `Identity`.
#[derive(Clone)]
pub struct Identity {
    cert: Certificate,
    key: Vec<u8>,
}

impl Identity {
    /// An identity from a PEM certificate chain (the leaf first) and a PEM private key.
    pub fn from_pem(cert: impl AsRef<[u8]>, key: impl AsRef<[u8]>) -> Identity {
        Identity {
            cert: Certificate::from_pem(cert),
            key: key.as_ref().to_vec(),
        }
    }

    fn parse(&self, whose: &str) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
        let chain = parse_certs(
            self.cert.get_ref(),
            &format!("{whose} identity's certificate"),
        )?;
        let key = PrivateKeyDer::from_pem_slice(&self.key).map_err(|e| {
            Error::Config(format!(
                "the {whose} identity's key is no PEM private key ({e}); pass the key file (a PKCS8, PKCS1 or SEC1 PEM key) as the second argument of Identity::from_pem"
            ))
        })?;
        Ok((chain, key))
    }

    fn tonic(&self) -> tonic::transport::Identity {
        tonic::transport::Identity::from_pem(self.cert.get_ref(), &self.key)
    }
}

// By hand: the key must never reach a log.
impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity").finish_non_exhaustive()
    }
}

fn parse_certs(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::Config(format!("the {what} is no valid PEM ({e})")))?;
    if certs.is_empty() {
        return Err(Error::Config(format!(
            "the {what} holds no certificate (expected -----BEGIN CERTIFICATE-----)"
        )));
    }
    Ok(certs)
}

fn roots(certs: &[Certificate], anchors: &[TrustAnchor<'static>]) -> Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::from_iter(anchors.iter().cloned());
    for c in certs {
        for der in parse_certs(c.get_ref(), "CA certificate")? {
            roots.add(der).map_err(|e| {
                Error::Config(format!("a CA certificate cannot be used as a root: {e}"))
            })?;
        }
    }
    Ok(roots)
}

/// The crypto provider: the process default where one is installed, else ring (as tonic's
/// `tls-ring`).
#[allow(deprecated)] // ring's provider lacks post-quantum key exchange; it is the one built in
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()))
}

fn tls_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Config(format!("{what}: {e}"))
}

/// The ALPN protocol tonic's server and client offer.
const ALPN_H2: &[u8] = b"h2";

/// A server's TLS settings, as tonic's `ServerTlsConfig`.
#[derive(Clone, Debug, Default)]
pub struct ServerTlsConfig {
    identity: Option<Identity>,
    client_ca_root: Option<Certificate>,
    client_auth_optional: bool,
    timeout: Option<Duration>,
}

impl ServerTlsConfig {
    /// No settings yet: an [`identity`](Self::identity) is required.
    pub fn new() -> ServerTlsConfig {
        ServerTlsConfig::default()
    }

    /// The server's certificate chain and key.
    pub fn identity(self, identity: Identity) -> ServerTlsConfig {
        ServerTlsConfig {
            identity: Some(identity),
            ..self
        }
    }

    /// Requires client certificates signed by this CA (mutual TLS).
    pub fn client_ca_root(self, cert: Certificate) -> ServerTlsConfig {
        ServerTlsConfig {
            client_ca_root: Some(cert),
            ..self
        }
    }

    /// With a client CA: also accept clients that present no certificate (default false).
    pub fn client_auth_optional(self, optional: bool) -> ServerTlsConfig {
        ServerTlsConfig {
            client_auth_optional: optional,
            ..self
        }
    }

    /// How long the handshake may take. On Ibex addresses it bounds the whole set-up (TLS
    /// and the Ibex preface: [`Config::handshake_timeout`](crate::Config::handshake_timeout)).
    pub fn timeout(self, timeout: Duration) -> ServerTlsConfig {
        ServerTlsConfig {
            timeout: Some(timeout),
            ..self
        }
    }

    /// The tcp provider's setting ([`Config::tls`](crate::Config::tls)), for a listener
    /// made beforehand ([`crate::listen`], then
    /// [`Builder::serve_with_listener`](super::Builder::serve_with_listener)).
    pub fn transport(&self) -> Result<Tls> {
        Ok(Tls::server(self.rustls()?))
    }

    /// The rustls configuration for the tcp provider.
    pub(crate) fn rustls(&self) -> Result<Arc<rustls::ServerConfig>> {
        let Some(identity) = &self.identity else {
            return Err(Error::Config(
                "ServerTlsConfig has no identity: add .identity(Identity::from_pem(cert, key))"
                    .into(),
            ));
        };
        let b = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_err("no TLS version in common with the crypto provider", e))?;
        let b = match &self.client_ca_root {
            None => b.with_no_client_auth(),
            Some(ca) => {
                let roots = Arc::new(roots(std::slice::from_ref(ca), &[])?);
                let v =
                    rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider());
                let v = if self.client_auth_optional {
                    v.allow_unauthenticated()
                } else {
                    v
                };
                b.with_client_cert_verifier(
                    v.build()
                        .map_err(|e| tls_err("the client CA cannot verify clients", e))?,
                )
            }
        };
        let (chain, key) = identity.parse("server")?;
        let mut c = b.with_single_cert(chain, key).map_err(|e| {
            tls_err(
                "the server identity's certificate and key do not make a TLS identity",
                e,
            )
        })?;
        c.alpn_protocols.push(ALPN_H2.into());
        Ok(Arc::new(c))
    }

    /// The same settings for stock tonic's server.
    pub(crate) fn tonic(&self) -> tonic::transport::ServerTlsConfig {
        let mut t = tonic::transport::ServerTlsConfig::new()
            .client_auth_optional(self.client_auth_optional);
        if let Some(i) = &self.identity {
            t = t.identity(i.tonic());
        }
        if let Some(ca) = &self.client_ca_root {
            t = t.client_ca_root(ca.clone());
        }
        if let Some(d) = self.timeout {
            t = t.timeout(d);
        }
        t
    }

    pub(crate) fn handshake_timeout(&self) -> Option<Duration> {
        self.timeout
    }
}

/// A client's TLS settings, as tonic's `ClientTlsConfig`.
#[derive(Clone, Debug, Default)]
pub struct ClientTlsConfig {
    domain: Option<String>,
    certs: Vec<Certificate>,
    trust_anchors: Vec<TrustAnchor<'static>>,
    identity: Option<Identity>,
    assume_http2: bool,
    webpki_roots: bool,
    native_roots: bool,
    timeout: Option<Duration>,
}

impl ClientTlsConfig {
    /// No settings yet: trust roots come from [`ca_certificate`](Self::ca_certificate).
    pub fn new() -> ClientTlsConfig {
        ClientTlsConfig::default()
    }

    /// The name the server's certificate must hold (default: the host of the address).
    pub fn domain_name(self, domain_name: impl Into<String>) -> ClientTlsConfig {
        ClientTlsConfig {
            domain: Some(domain_name.into()),
            ..self
        }
    }

    /// Trusts this CA.
    pub fn ca_certificate(mut self, ca_certificate: Certificate) -> ClientTlsConfig {
        self.certs.push(ca_certificate);
        self
    }

    /// Trusts these CAs.
    pub fn ca_certificates(
        mut self,
        ca_certificates: impl IntoIterator<Item = Certificate>,
    ) -> ClientTlsConfig {
        self.certs.extend(ca_certificates);
        self
    }

    /// Trusts this anchor.
    pub fn trust_anchor(mut self, trust_anchor: TrustAnchor<'static>) -> ClientTlsConfig {
        self.trust_anchors.push(trust_anchor);
        self
    }

    /// Trusts these anchors.
    pub fn trust_anchors(
        mut self,
        trust_anchors: impl IntoIterator<Item = TrustAnchor<'static>>,
    ) -> ClientTlsConfig {
        self.trust_anchors.extend(trust_anchors);
        self
    }

    /// The client's certificate and key, for servers that require one (mutual TLS).
    pub fn identity(self, identity: Identity) -> ClientTlsConfig {
        ClientTlsConfig {
            identity: Some(identity),
            ..self
        }
    }

    /// Over HTTP/2: speak HTTP/2 even if the server does not negotiate it with ALPN.
    /// Ibex addresses ignore it.
    pub fn assume_http2(self, assume_http2: bool) -> ClientTlsConfig {
        ClientTlsConfig {
            assume_http2,
            ..self
        }
    }

    /// The Mozilla roots, as tonic's `tls-webpki-roots`: not built into Ibex, so
    /// [`Endpoint::tls_config`](super::Endpoint::tls_config) refuses it with the fix.
    pub fn with_webpki_roots(self) -> ClientTlsConfig {
        ClientTlsConfig {
            webpki_roots: true,
            ..self
        }
    }

    /// The system's roots, as tonic's `tls-native-roots`: not built into Ibex, so
    /// [`Endpoint::tls_config`](super::Endpoint::tls_config) refuses it with the fix.
    pub fn with_native_roots(self) -> ClientTlsConfig {
        ClientTlsConfig {
            native_roots: true,
            ..self
        }
    }

    /// The roots of the root features built in; as in a tonic built without them, none.
    pub fn with_enabled_roots(self) -> ClientTlsConfig {
        self
    }

    /// How long the handshake may take (default: the connect timeout).
    pub fn timeout(self, timeout: Duration) -> ClientTlsConfig {
        ClientTlsConfig {
            timeout: Some(timeout),
            ..self
        }
    }

    fn check_roots(&self) -> Result<()> {
        let which = match (self.webpki_roots, self.native_roots) {
            (true, _) => "with_webpki_roots",
            (_, true) => "with_native_roots",
            _ => return Ok(()),
        };
        Err(Error::Config(format!(
            "ClientTlsConfig::{which}: this build of Ibex bundles no public roots; add the server's CA with ClientTlsConfig::ca_certificate (or trust_anchors)"
        )))
    }

    /// The tcp provider's setting ([`Config::tls`](crate::Config::tls)), for
    /// [`crate::connect`] or [`Channel::connect_with_config`](super::Channel::connect_with_config).
    pub fn transport(&self) -> Result<Tls> {
        self.check_roots()?;
        if self.certs.is_empty() && self.trust_anchors.is_empty() {
            return Err(Error::Config(
                "ClientTlsConfig trusts no CA, so no server could be verified: add .ca_certificate(Certificate::from_pem(ca))".into(),
            ));
        }
        let b = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_err("no TLS version in common with the crypto provider", e))?
            .with_root_certificates(roots(&self.certs, &self.trust_anchors)?);
        let mut c = match &self.identity {
            None => b.with_no_client_auth(),
            Some(id) => {
                let (chain, key) = id.parse("client")?;
                b.with_client_auth_cert(chain, key).map_err(|e| {
                    tls_err(
                        "the client identity's certificate and key do not make a TLS identity",
                        e,
                    )
                })?
            }
        };
        c.alpn_protocols.push(ALPN_H2.into());
        let tls = Tls::client(Arc::new(c));
        Ok(match &self.domain {
            Some(d) => tls.server_name(d.clone()),
            None => tls,
        })
    }

    /// The same settings for stock tonic's channel.
    pub(crate) fn tonic(&self) -> Result<tonic::transport::ClientTlsConfig> {
        self.check_roots()?;
        let mut t = tonic::transport::ClientTlsConfig::new()
            .ca_certificates(self.certs.iter().cloned())
            .trust_anchors(self.trust_anchors.iter().cloned())
            .assume_http2(self.assume_http2);
        if let Some(d) = &self.domain {
            t = t.domain_name(d.clone());
        }
        if let Some(i) = &self.identity {
            t = t.identity(i.tonic());
        }
        if let Some(d) = self.timeout {
            t = t.timeout(d);
        }
        Ok(t)
    }

    pub(crate) fn handshake_timeout(&self) -> Option<Duration> {
        self.timeout
    }
}
