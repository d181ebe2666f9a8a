//! The transports under test and one client type that calls the `Bench` service over any of
//! them.

use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use clap::ValueEnum;
use ibex_proto::bench::v1::bench_client::BenchClient;
use ibex_proto::bench::v1::bench_ibex::BenchClient as IbexClient;
use ibex_proto::bench::v1::{Ack, Payload};
use ibex_transport::{Config, Connection};

use crate::Res;
use crate::payload::Msg;
use crate::server::{MAX_MSG, RAW_ECHO, RAW_SINK, TENSOR_MAGIC};

/// A transport under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// Stock tonic, HTTP/2 over TCP loopback, default settings (16 KiB frames): the baseline.
    #[value(alias = "grpc")]
    Tonic,
    /// Stock tonic with 1 MiB HTTP/2 frames on both sides (its best large-message setting).
    #[value(name = "tonic-1m")]
    #[serde(rename = "tonic-1m")]
    Tonic1m,
    /// The same gRPC service over Ibex shared memory.
    #[value(alias = "shm")]
    IbexShm,
    /// The same gRPC service over Ibex shared memory with busy-polling on both ends: the one
    /// setting `Config::busy_poll` (`IBEX_BUSY_POLL=1`).
    IbexShmBusy,
    /// The same gRPC service over Ibex tcp.
    #[value(alias = "tcp")]
    IbexTcp,
    /// Ibex tcp with TLS (rustls, the test certificates of `transport/tests/data/tls`).
    IbexTcpTls,
    /// Stock tonic with TLS (`https://`, tonic's `tls-ring`, the same certificates).
    TonicTls,
    /// The same gRPC service over Ibex verbs (build with `--features verbs`, needs a device).
    #[value(alias = "verbs")]
    IbexVerbs,
    /// The Ibex transport without the gRPC layer, shm (messages, no protobuf, no calls).
    RawShm,
    /// The Ibex transport without the gRPC layer, tcp.
    RawTcp,
    /// The floor of a tonic-compatible layer over shm, not a transport to use: the raw shm
    /// transport with protobuf and tonic's per-call types, and no call framing.
    RawShmTypes,
}

impl Transport {
    /// Every transport this build and host can run, baseline first.
    pub fn available() -> Vec<Transport> {
        let mut v = vec![
            Transport::Tonic,
            Transport::Tonic1m,
            Transport::IbexShm,
            Transport::IbexShmBusy,
            Transport::IbexTcp,
        ];
        if cfg!(feature = "verbs")
            && std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
        {
            v.push(Transport::IbexVerbs);
        }
        v.extend([Transport::RawShm, Transport::RawTcp, Transport::RawShmTypes]);
        v
    }

    /// The name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tonic => "tonic",
            Transport::Tonic1m => "tonic-1m",
            Transport::IbexShm => "ibex-shm",
            Transport::IbexShmBusy => "ibex-shm-busy",
            Transport::IbexTcp => "ibex-tcp",
            Transport::IbexTcpTls => "ibex-tcp-tls",
            Transport::TonicTls => "tonic-tls",
            Transport::IbexVerbs => "ibex-verbs",
            Transport::RawShm => "raw-shm",
            Transport::RawTcp => "raw-tcp",
            Transport::RawShmTypes => "raw-shm-types",
        }
    }
}

impl Transport {
    /// The Ibex configuration this transport runs with: the environment's, on top of
    /// busy-polling for the busy variant (`IBEX_SPIN_US` and `IBEX_SERVE_THREADS` still
    /// override it).
    pub fn config(self) -> Res<Config> {
        let base = if self == Transport::IbexShmBusy {
            Config::default().busy_poll()
        } else {
            Config::default()
        };
        Ok(base.with_env()?)
    }
}

/// A client of the `Bench` service (or of the raw peer). Cheap to clone: clones share the
/// underlying connection, as concurrent calls on one gRPC channel do.
#[derive(Clone)]
pub enum Client {
    /// Stock tonic.
    Tonic(BenchClient<tonic::transport::Channel>),
    /// The generated Ibex client (its unary calls direct) over an Ibex channel.
    Ibex(IbexClient, ibex_transport::grpc::Channel),
    /// The raw transport.
    Raw(Arc<Connection>),
    /// The raw transport with tonic's per-call types around protobuf messages.
    Typed(Arc<Typed>),
}

/// A `raw-shm-types` client's connection and the response headers a caller's metadata
/// holds over `ibex-shm` (content type, date, `grpc-status: 0`), made once.
pub struct Typed {
    conn: Connection,
    response_headers: http::HeaderMap,
}

impl Typed {
    fn new(conn: Connection) -> Typed {
        let mut response_headers = http::HeaderMap::new();
        response_headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        response_headers.insert(
            http::header::DATE,
            http::HeaderValue::from_static("Fri, 27 Nov 2026 22:00:00 GMT"),
        );
        response_headers.insert("grpc-status", http::HeaderValue::from_static("0"));
        Typed {
            conn,
            response_headers,
        }
    }

    /// One call: what a generated client does with the request (it hands its channel the
    /// request's parts), the message there with `tag` in front, and the answer as a caller
    /// gets it (a `tonic::Response` with its metadata).
    async fn call<Q: prost::Message, A: prost::Message + Default>(
        &self,
        tag: u8,
        msg: Q,
    ) -> Res<A> {
        let (metadata, extensions, msg) = tonic::Request::new(msg).into_parts();
        let mut buf = BytesMut::with_capacity(1 + msg.encoded_len());
        buf.put_u8(tag);
        msg.encode(&mut buf)?;
        drop((metadata, extensions, msg));
        self.conn.send(buf.freeze()).await?;
        let mut answer = self.conn.recv().await?;
        if answer.is_empty() {
            return Err("the raw-shm-types peer answered an empty message".into());
        }
        answer.advance(1);
        let msg = A::decode(answer)?;
        let response = tonic::Response::from_parts(
            tonic::metadata::MetadataMap::from_headers(self.response_headers.clone()),
            msg,
            tonic::Extensions::new(),
        );
        Ok(response.into_inner())
    }
}

fn err(what: &str, e: impl std::fmt::Display) -> Box<dyn std::error::Error + Send + Sync> {
    format!("{what}: {e}").into()
}

impl Client {
    /// Connects to a server started by `ibex-bench server --transport t`.
    pub async fn connect(t: Transport, addr: &str) -> Res<Client> {
        Ok(match t {
            Transport::Tonic | Transport::Tonic1m => {
                let uri = if addr.starts_with("http://") {
                    addr.to_string()
                } else {
                    format!("http://{addr}")
                };
                let mut ep = tonic::transport::Endpoint::from_shared(uri)?.tcp_nodelay(true);
                if t == Transport::Tonic1m {
                    ep = ep.max_frame_size((1u32 << 20) - 1);
                }
                let ch = ep
                    .connect()
                    .await
                    .map_err(|e| err(&format!("connecting to {addr}"), e))?;
                Client::Tonic(
                    BenchClient::new(ch)
                        .max_decoding_message_size(MAX_MSG)
                        .max_encoding_message_size(MAX_MSG),
                )
            }
            Transport::IbexShm
            | Transport::IbexShmBusy
            | Transport::IbexTcp
            | Transport::IbexVerbs => {
                let ch =
                    ibex_transport::grpc::Channel::connect_with_config(addr, t.config()?).await?;
                let c = IbexClient::new(ch.clone())
                    .max_decoding_message_size(MAX_MSG)
                    .max_encoding_message_size(MAX_MSG);
                Client::Ibex(c, ch)
            }
            Transport::IbexTcpTls => {
                let mut config = t.config()?;
                config.tls = Some(bench_tls::client().transport()?);
                let ch = ibex_transport::grpc::Channel::connect_with_config(addr, config).await?;
                let c = IbexClient::new(ch.clone())
                    .max_decoding_message_size(MAX_MSG)
                    .max_encoding_message_size(MAX_MSG);
                Client::Ibex(c, ch)
            }
            Transport::TonicTls => {
                let ch = ibex_transport::grpc::Endpoint::new(addr)?
                    .tls_config(bench_tls::client())?
                    .connect()
                    .await?;
                let c = IbexClient::new(ch.clone())
                    .max_decoding_message_size(MAX_MSG)
                    .max_encoding_message_size(MAX_MSG);
                Client::Ibex(c, ch)
            }
            Transport::RawShm | Transport::RawTcp | Transport::RawShmTypes => {
                let conn = ibex_transport::connect(addr, t.config()?).await?;
                conn.probe_done().await;
                if t == Transport::RawShmTypes {
                    Client::Typed(Arc::new(Typed::new(conn)))
                } else {
                    Client::Raw(Arc::new(conn))
                }
            }
        })
    }

    /// One Echo call (raw: one message there and back). Returns the bytes that came back.
    pub async fn echo(&mut self, m: &Msg) -> Res<usize> {
        Ok(match self {
            Client::Tonic(c) => size(&c.echo(m.payload.clone()).await?.into_inner()),
            Client::Ibex(c, _) => size(&c.echo(m.payload.clone()).await?.into_inner()),
            Client::Raw(c) => {
                c.send(retag(&m.raw, RAW_ECHO)).await?;
                c.recv().await?.len()
            }
            Client::Typed(c) => size(&c.call::<_, Payload>(RAW_ECHO, m.payload.clone()).await?),
        })
    }

    /// One Sink call (raw: one message, one 1-byte acknowledgement). Returns the bytes the
    /// server says it got.
    pub async fn sink(&mut self, m: &Msg) -> Res<usize> {
        Ok(match self {
            Client::Tonic(c) => c.sink(m.payload.clone()).await?.into_inner().bytes as usize,
            Client::Ibex(c, _) => c.sink(m.payload.clone()).await?.into_inner().bytes as usize,
            Client::Raw(c) => {
                c.send(retag(&m.raw, RAW_SINK)).await?;
                c.recv().await?;
                m.raw.len()
            }
            Client::Typed(c) => c.call::<_, Ack>(RAW_SINK, m.payload.clone()).await?.bytes as usize,
        })
    }

    /// A tensor of `data.len()` bytes to the server by the cheapest path this transport has:
    /// Ibex gRPC sends a descriptor and the handler pulls the buffer (`read_remote`); the raw
    /// transport sends the buffer itself; stock tonic sends it in the message body.
    pub async fn tensor(&mut self, data: &Bytes) -> Res<usize> {
        match self {
            Client::Tonic(c) => Ok(c
                .sink(Payload {
                    buffers: vec![data.clone()],
                })
                .await?
                .into_inner()
                .bytes as usize),
            Client::Ibex(c, ch) => {
                // The exposure must outlive the call that carries its descriptor (docs/grpc.md).
                let remote = ch.expose(data.clone()).await?;
                let p = Payload {
                    buffers: vec![
                        Bytes::from_static(TENSOR_MAGIC),
                        remote.descriptor(),
                        Bytes::copy_from_slice(&(data.len() as u64).to_le_bytes()),
                    ],
                };
                let n = c.sink(p).await?.into_inner().bytes as usize;
                drop(remote);
                Ok(n)
            }
            Client::Raw(c) => {
                c.send(data.clone()).await?;
                c.recv().await?;
                Ok(data.len())
            }
            // A Sink of the tensor as one buffer, as stock tonic sends it.
            Client::Typed(c) => Ok(c
                .call::<_, Ack>(
                    RAW_SINK,
                    Payload {
                        buffers: vec![data.clone()],
                    },
                )
                .await?
                .bytes as usize),
        }
    }

    /// A tensor buffer to pass to [`Client::tensor`]: from the connection's registered pool
    /// where it has one (no copy on shm), plain heap memory otherwise.
    pub fn tensor_buffer(&self, len: usize) -> Res<Bytes> {
        let pool = match self {
            Client::Ibex(_, ch) => ch.connection().and_then(|c| c.pool()),
            Client::Raw(c) => c.pool(),
            Client::Typed(c) => c.conn.pool(),
            Client::Tonic(_) => None,
        };
        let mut v = match pool {
            Some(p) => {
                let mut b = p.alloc(len)?;
                b.fill(0x33);
                b[0] = RAW_SINK;
                return Ok(b.freeze());
            }
            None => vec![0x33u8; len],
        };
        v[0] = RAW_SINK;
        Ok(Bytes::from(v))
    }

    /// Closes the connection cleanly where the transport has a close.
    pub async fn close(self) {
        match self {
            Client::Raw(c) => c.close().await,
            Client::Typed(c) => c.conn.close().await,
            Client::Tonic(_) | Client::Ibex(..) => {}
        }
    }
}

fn size(p: &Payload) -> usize {
    p.buffers.iter().map(|b| b.len()).sum()
}

/// The raw message with its tag byte; reuses the buffer when the tag is already right.
fn retag(raw: &Bytes, tag: u8) -> Bytes {
    if raw.first() == Some(&tag) {
        return raw.clone();
    }
    let mut v = raw.to_vec();
    v[0] = tag;
    Bytes::from(v)
}

/// The TLS settings of the `-tls` transports: the test certificates, never for production.
pub mod bench_tls {
    use ibex_transport::grpc::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

    const CA: &[u8] = include_bytes!("../../transport/tests/data/tls/ca.pem");
    const CERT: &[u8] = include_bytes!("../../transport/tests/data/tls/server.pem");
    const KEY: &[u8] = include_bytes!("../../transport/tests/data/tls/server.key");

    pub fn server() -> ServerTlsConfig {
        ServerTlsConfig::new().identity(Identity::from_pem(CERT, KEY))
    }

    pub fn client() -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(CA))
    }
}
