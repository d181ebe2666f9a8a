//! TLS over the tcp provider: messages of every path (eager, pushed, read by request)
//! round-trip encrypted, mutual TLS exposes the peer's certificates, every misconfiguration
//! fails with an error that names it, and no payload or token byte crosses the wire in
//! clear. Certificates: `tests/data/tls` (see its README).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ibex_transport::tls::{Tls, rustls};
use ibex_transport::{Config, Connection, connect, listen, tcp};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

mod conn_util;
use conn_util::{fixed_threshold, init_tracing, pattern};

const GUARD: Duration = Duration::from_secs(60);

fn data(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/tls/{name}"))
}

fn certs(name: &str) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(data(&format!("{name}.pem")))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

fn key(name: &str) -> PrivateKeyDer<'static> {
    PrivateKeyDer::from_pem_file(data(&format!("{name}.key"))).unwrap()
}

// ring is the provider built in, as with tonic's `tls-ring`.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(ca: &str) -> Arc<rustls::RootCertStore> {
    let mut r = rustls::RootCertStore::empty();
    for c in certs(ca) {
        r.add(c).unwrap();
    }
    Arc::new(r)
}

/// The server's setting; `client_ca`: require client certificates signed by it.
fn server_tls(client_ca: Option<&str>) -> Tls {
    let b = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap();
    let b = match client_ca {
        Some(ca) => b.with_client_cert_verifier(
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots(ca), provider())
                .build()
                .unwrap(),
        ),
        None => b.with_no_client_auth(),
    };
    Tls::server(Arc::new(
        b.with_single_cert(certs("server"), key("server")).unwrap(),
    ))
}

/// A client's setting trusting `ca`, with `identity` as its own certificate.
fn client_tls(ca: &str, identity: Option<&str>) -> Tls {
    let b = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots(ca));
    let c = match identity {
        Some(id) => b.with_client_auth_cert(certs(id), key(id)).unwrap(),
        None => b.with_no_client_auth(),
    };
    Tls::client(Arc::new(c))
}

fn config(tls: Option<Tls>) -> Config {
    Config {
        tls,
        ..fixed_threshold(16 << 10)
    }
}

async fn pair(server: Config, client: Config) -> (Connection, Connection) {
    init_tracing();
    let l = listen("tcp://127.0.0.1:0", server).await.expect("listen");
    let at = l.local_uri();
    let (a, b) = tokio::join!(l.accept(), connect(&at, client));
    (a.expect("accept"), b.expect("connect"))
}

/// Eager, pushed and requested bodies, both ways.
async fn round_trip(a: &Connection, b: &Connection) {
    for (i, len) in [64usize, 60_000, 200_000, 3 << 20].into_iter().enumerate() {
        let msg = pattern(len, i as u8);
        a.send(msg.clone()).await.unwrap();
        assert_eq!(b.recv().await.unwrap(), msg, "a->b {len} bytes");
        b.send(msg.clone()).await.unwrap();
        assert_eq!(a.recv().await.unwrap(), msg, "b->a {len} bytes");
    }
    // An exposed buffer read with explicit requests.
    let buf = pattern(2 << 20, 9);
    let remote = a.expose(buf.clone()).await.unwrap();
    let dst = ibex_transport::RecvBuf::heap(buf.len());
    let got = b.read_remote(remote.descriptor(), dst).await.unwrap();
    assert_eq!(got.as_slice(), &buf[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_every_size_round_trip_over_tls() {
    tokio::time::timeout(GUARD, async {
        let (s, c) = pair(
            config(Some(server_tls(None))),
            config(Some(client_tls("ca", None))),
        )
        .await;
        assert!(s.is_tls() && c.is_tls());
        round_trip(&c, &s).await;
        // The client sees the server's chain; the server got no client certificate.
        let chain = c.peer_certs().expect("server certificates");
        assert_eq!(chain[0], certs("server")[0]);
        assert!(s.peer_certs().is_none());
        assert!(s.local_addr().is_some() && c.local_addr().is_some());
        c.close().await;
        s.closed().await;
    })
    .await
    .expect("hang guard");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_exposes_the_client_certificate() {
    tokio::time::timeout(GUARD, async {
        let (s, c) = pair(
            config(Some(server_tls(Some("ca")))),
            config(Some(client_tls("ca", Some("client")))),
        )
        .await;
        round_trip(&s, &c).await;
        let chain = s.peer_certs().expect("client certificates");
        assert_eq!(chain[0], certs("client")[0]);
        assert_eq!(
            c.peer_certs().expect("server certificates")[0],
            certs("server")[0]
        );
    })
    .await
    .expect("hang guard");
}

/// Sets up one tcp link pair with these settings; the two sides' results.
async fn link_pair(
    server: Config,
    client: Config,
    name: Option<&str>,
) -> (ibex_transport::Result<()>, ibex_transport::Result<()>) {
    init_tracing();
    let l = tcp::listen("127.0.0.1:0", &server).await.unwrap();
    let port = l.local_addr().unwrap().port();
    let at = format!("{}:{port}", name.unwrap_or("127.0.0.1"));
    let (a, b) = tokio::join!(l.accept(), tcp::connect(&at, &client));
    (a.map(|_| ()), b.map(|_| ()))
}

fn err_text(r: ibex_transport::Result<()>) -> String {
    r.expect_err("set-up must fail").to_string()
}

#[tokio::test]
async fn a_plain_client_at_a_tls_listener_is_told_to_use_tls() {
    let (s, c) = link_pair(config(Some(server_tls(None))), config(None), None).await;
    let (s, c) = (err_text(s), err_text(c));
    assert!(
        s.contains(
            "speaks plain Ibex tcp but this listener requires TLS; configure the client with tls"
        ),
        "{s}"
    );
    assert!(c.contains("requires TLS"), "{c}");
}

#[tokio::test]
async fn a_tls_client_at_a_plain_listener_is_told_the_server_does_not_speak_tls() {
    let (s, c) = link_pair(config(None), config(Some(client_tls("ca", None))), None).await;
    let (s, c) = (err_text(s), err_text(c));
    assert!(
        s.contains("speaks TLS (it opened with a TLS ClientHello)"),
        "{s}"
    );
    assert!(c.contains("does not speak TLS"), "{c}");
}

#[tokio::test]
async fn a_server_signed_by_an_unknown_ca_is_refused() {
    let (_, c) = link_pair(
        config(Some(server_tls(None))),
        config(Some(client_tls("other-ca", None))),
        None,
    )
    .await;
    let c = err_text(c);
    assert!(
        c.contains("unknown issuer") && c.contains("ca_certificate"),
        "{c}"
    );
}

#[tokio::test]
async fn a_server_name_the_certificate_lacks_is_refused() {
    let client = client_tls("ca", None).server_name("ps0.example.com");
    let (_, c) = link_pair(config(Some(server_tls(None))), config(Some(client)), None).await;
    let c = err_text(c);
    assert!(
        c.contains("name mismatch") && c.contains("domain_name"),
        "{c}"
    );
    // The host part of the address is the default name: "localhost" is in the certificate.
    let (s, c) = link_pair(
        config(Some(server_tls(None))),
        config(Some(client_tls("ca", None))),
        Some("localhost"),
    )
    .await;
    s.unwrap();
    c.unwrap();
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused_where_one_is_required() {
    let (s, c) = link_pair(
        config(Some(server_tls(Some("ca")))),
        config(Some(client_tls("ca", None))),
        None,
    )
    .await;
    let (s, c) = (err_text(s), err_text(c));
    assert!(
        s.contains("sent no client certificate") && s.contains("identity"),
        "{s}"
    );
    assert!(c.contains("requires a client certificate"), "{c}");
    // One signed by a CA the server does not trust is refused too.
    let (s, _) = link_pair(
        config(Some(server_tls(Some("ca")))),
        config(Some(client_tls("ca", Some("other-client")))),
        None,
    )
    .await;
    let s = err_text(s);
    assert!(
        s.contains("unknown issuer") && s.contains("client_ca_root"),
        "{s}"
    );
}

#[tokio::test]
async fn tls_on_verbs_is_refused_with_the_reason() {
    for c in [
        config(Some(client_tls("ca", None))),
        config(Some(server_tls(None))),
    ] {
        let e = connect("verbs://127.0.0.1:1", c.clone()).await.unwrap_err();
        assert!(
            e.to_string().contains("verbs traffic is not encrypted"),
            "{e}"
        );
        let Err(e) = listen("verbs://127.0.0.1:0", c).await else {
            panic!("a verbs listener with tls must be refused");
        };
        assert!(
            e.to_string().contains("use a tcp:// address for TLS"),
            "{e}"
        );
    }
}

/// A TCP relay that records every byte it passes, both ways.
async fn recording_proxy(to: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        let (a, _) = l.accept().await.unwrap();
        let b = tokio::net::TcpStream::connect(to).await.unwrap();
        let (ar, aw) = a.into_split();
        let (br, bw) = b.into_split();
        let pump = |mut r: tokio::net::tcp::OwnedReadHalf,
                    mut w: tokio::net::tcp::OwnedWriteHalf,
                    log: Arc<Mutex<Vec<u8>>>| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = match r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                log.lock().unwrap().extend_from_slice(&buf[..n]);
                if w.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = w.shutdown().await;
        };
        tokio::join!(pump(ar, bw, log.clone()), pump(br, aw, log));
    });
    (at, seen)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Sends a 1 MiB pattern both ways through a recording relay, with an auth token; what
/// the wire carried.
async fn through_proxy(tls: bool) -> (Vec<u8>, Bytes, String) {
    init_tracing();
    let token = "tok-7f3a9c1e-never-in-clear".to_string();
    let mut server = config(tls.then(|| server_tls(None)));
    server.auth_token = Some(token.clone());
    let mut client = config(tls.then(|| client_tls("ca", None).server_name("localhost")));
    client.auth_token = Some(token.clone());
    let l = listen("tcp://127.0.0.1:0", server).await.unwrap();
    let addr = l.local_uri().trim_start_matches("tcp://").to_string();
    let (via, seen) = recording_proxy(addr).await;
    let via = format!("tcp://{via}");
    let (s, c) = tokio::join!(l.accept(), connect(&via, client));
    let (s, c) = (s.unwrap(), c.unwrap());
    let msg = pattern(1 << 20, 77);
    c.send(msg.clone()).await.unwrap();
    assert_eq!(s.recv().await.unwrap(), msg);
    s.send(msg.clone()).await.unwrap();
    assert_eq!(c.recv().await.unwrap(), msg);
    // A small one too, which goes eagerly inside a frame.
    let small = Bytes::from_static(b"small-eager-message-that-must-not-be-seen");
    c.send(small.clone()).await.unwrap();
    assert_eq!(s.recv().await.unwrap(), small);
    c.close().await;
    s.closed().await;
    let seen = seen.lock().unwrap().clone();
    (seen, msg, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_payload_or_token_byte_crosses_the_wire_in_clear() {
    tokio::time::timeout(GUARD, async {
        // The control: plain tcp shows all three, so the relay sees what it should.
        let (seen, msg, token) = through_proxy(false).await;
        assert!(contains(&seen, &msg[1000..1064]));
        assert!(contains(&seen, token.as_bytes()));
        assert!(contains(&seen, b"small-eager-message"));
        let (seen, msg, token) = through_proxy(true).await;
        assert!(
            seen.len() > 2 << 20,
            "the relay carried {} bytes",
            seen.len()
        );
        for at in (0..msg.len() - 64).step_by(64 << 10) {
            assert!(
                !contains(&seen, &msg[at..at + 64]),
                "payload at {at} in clear"
            );
        }
        assert!(!contains(&seen, token.as_bytes()), "auth token in clear");
        assert!(!contains(&seen, b"small-eager-message"));
        assert!(!contains(&seen, b"IBEXTCP"), "preface in clear");
    })
    .await
    .expect("hang guard");
}

/// Bad peers at a TLS listener (junk that looks like a ClientHello, a plain preface, a
/// silent socket) cost only their own connections: an honest TLS client is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_peers_at_a_tls_listener_do_not_hold_up_an_honest_one() {
    use tokio::io::AsyncWriteExt;
    tokio::time::timeout(GUARD, async {
        init_tracing();
        let mut server = config(Some(server_tls(None)));
        server.handshake_timeout = Duration::from_millis(500);
        let l = listen("tcp://127.0.0.1:0", server).await.unwrap();
        let at = l.local_uri();
        let addr = at.trim_start_matches("tcp://").to_string();
        let mut junk = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let mut hello = vec![0x16, 0x03, 0x01, 0x40, 0x00];
        hello.extend(std::iter::repeat_n(0xab, 16 << 10));
        junk.write_all(&hello).await.unwrap();
        let mut plain = tokio::net::TcpStream::connect(&addr).await.unwrap();
        plain
            .write_all(b"IBEXTCP\0 and then nothing sensible")
            .await
            .unwrap();
        let _silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let (s, c) = tokio::join!(
            l.accept(),
            connect(&at, config(Some(client_tls("ca", None))))
        );
        let (s, c) = (s.unwrap(), c.unwrap());
        let msg = pattern(300_000, 3);
        c.send(msg.clone()).await.unwrap();
        assert_eq!(s.recv().await.unwrap(), msg);
        // The bad peers are closed (junk at once, silence at the deadline).
        for mut bad in [junk, plain] {
            use tokio::io::AsyncReadExt;
            let mut b = vec![0u8; 4096];
            loop {
                match bad.read(&mut b).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        }
    })
    .await
    .expect("hang guard");
}
