//! The server side: the `Bench` service over every transport, and the raw-transport peers.
//!
//! A server prints its connect address as the first line of stdout, so a parent process (or a
//! person on another host) can hand it to the client.

use std::io::Write;

use std::sync::Arc;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use ibex_proto::bench::v1::bench_ibex::{Bench, BenchServer};
use ibex_proto::bench::v1::{Ack, Payload, StreamRequest};
use ibex_transport::grpc::PeerHandle;
use ibex_transport::{Connection, RecvBuf};
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status, Streaming};

use crate::Res;
use crate::transport::Transport;

/// First buffer of a Sink payload that carries a descriptor instead of data: the handler
/// pulls the client's exposed buffer with [`PeerHandle::read_remote`].
pub const TENSOR_MAGIC: &[u8] = b"ibex-bench/tensor-descriptor/v1";

/// Raw transport: first byte of a message the peer echoes back.
pub const RAW_ECHO: u8 = 2;
/// Raw transport: first byte of a message the peer drops and acknowledges with one byte.
pub const RAW_SINK: u8 = 1;

/// Largest gRPC message either side accepts: the biggest sweep size plus headroom.
pub const MAX_MSG: usize = 80 << 20;

struct Svc;

#[tonic::async_trait]
impl Bench for Svc {
    async fn echo(&self, req: Request<Payload>) -> Result<Response<Payload>, Status> {
        Ok(Response::new(req.into_inner()))
    }

    async fn sink(&self, req: Request<Payload>) -> Result<Response<Ack>, Status> {
        let peer = req.extensions().get::<PeerHandle>().cloned();
        let p = req.into_inner();
        if p.buffers
            .first()
            .is_some_and(|b| b.as_ref() == TENSOR_MAGIC)
        {
            return tensor(peer, &p).await.map(Response::new);
        }
        Ok(Response::new(Ack {
            bytes: p.buffers.iter().map(|b| b.len() as u64).sum(),
            buffers: p.buffers.len() as u32,
        }))
    }

    type StreamStream = tokio_stream::Empty<Result<Payload, Status>>;
    async fn stream(
        &self,
        _: Request<StreamRequest>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        Err(Status::unimplemented("ibex-bench does not use Stream"))
    }

    type ChatStream = tokio_stream::Empty<Result<Payload, Status>>;
    async fn chat(
        &self,
        _: Request<Streaming<Payload>>,
    ) -> Result<Response<Self::ChatStream>, Status> {
        Err(Status::unimplemented("ibex-bench does not use Chat"))
    }

    async fn upload(&self, _: Request<Streaming<Payload>>) -> Result<Response<Ack>, Status> {
        Err(Status::unimplemented("ibex-bench does not use Upload"))
    }
}

/// The descriptor path: `[TENSOR_MAGIC, descriptor, len as u64 LE]`.
async fn tensor(peer: Option<PeerHandle>, p: &Payload) -> Result<Ack, Status> {
    let peer = peer.ok_or_else(|| {
        Status::failed_precondition(
            "tensor descriptors need an Ibex transport (no PeerHandle over stock tonic)",
        )
    })?;
    let (Some(desc), Some(len)) = (p.buffers.get(1), p.buffers.get(2)) else {
        return Err(Status::invalid_argument(
            "tensor payload must be [magic, descriptor, length]",
        ));
    };
    let len: [u8; 8] = len
        .as_ref()
        .try_into()
        .map_err(|_| Status::invalid_argument("tensor length must be 8 bytes (u64 LE)"))?;
    let len = u64::from_le_bytes(len) as usize;
    if len > MAX_MSG {
        return Err(Status::invalid_argument(format!(
            "tensor of {len} bytes is over the {MAX_MSG}-byte limit"
        )));
    }
    let buf = peer
        .read_remote(desc.clone(), RecvBuf::heap(len))
        .await
        .map_err(|e| Status::internal(format!("read_remote: {e}")))?;
    Ok(Ack {
        bytes: buf.len() as u64,
        buffers: 1,
    })
}

/// The default listen address of a transport on this host.
pub fn default_listen(t: Transport) -> String {
    match t {
        Transport::Tonic | Transport::Tonic1m | Transport::TonicTls => "127.0.0.1:0".into(),
        Transport::IbexShm
        | Transport::IbexShmBusy
        | Transport::RawShm
        | Transport::RawShmTypes => {
            format!(
                "shm://{}",
                std::env::temp_dir()
                    .join(format!("ibex-bench-{}.sock", std::process::id()))
                    .display()
            )
        }
        Transport::IbexTcp | Transport::IbexTcpTls | Transport::RawTcp => {
            "tcp://127.0.0.1:0".into()
        }
        Transport::IbexVerbs => "verbs://127.0.0.1:0".into(),
    }
}

fn announce(addr: &str) -> Res<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{addr}")?;
    out.flush()?;
    Ok(())
}

/// Runs a server until killed. Prints the client's connect address first.
/// `threads` 0 runs everything on one thread (no cross-thread wake-ups between the
/// connection driver and the handlers).
pub fn serve(t: Transport, listen: Option<String>, threads: usize) -> Res<()> {
    let listen = listen.unwrap_or_else(|| default_listen(t));
    let rt = if threads == 0 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()?
    };
    rt.block_on(async move {
        let svc = BenchServer::new(Svc)
            .max_decoding_message_size(MAX_MSG)
            .max_encoding_message_size(MAX_MSG);
        match t {
            Transport::Tonic | Transport::Tonic1m => {
                let l = tokio::net::TcpListener::bind(listen.trim_start_matches("http://")).await?;
                announce(&format!("http://{}", l.local_addr()?))?;
                let mut b = tonic::transport::Server::builder();
                if t == Transport::Tonic1m {
                    b = b.max_frame_size(Some((1 << 20) - 1));
                }
                // Only `serve(addr)` sets TCP_NODELAY itself; without it small calls wait for
                // delayed ACKs (40 ms) and the baseline would be unfairly slow.
                let incoming = tokio_stream::StreamExt::map(
                    tokio_stream::wrappers::TcpListenerStream::new(l),
                    |s| {
                        s.and_then(|s| {
                            s.set_nodelay(true)?;
                            Ok(s)
                        })
                    },
                );
                b.add_service(svc.into_tonic())
                    .serve_with_incoming(incoming)
                    .await?;
            }
            Transport::IbexShm
            | Transport::IbexShmBusy
            | Transport::IbexTcp
            | Transport::IbexVerbs => {
                let l = ibex_transport::listen(&listen, t.config()?).await?;
                announce(&l.local_uri())?;
                ibex_transport::grpc::Server::builder()
                    .add_service(svc)
                    .serve_with_listener(l, std::future::pending())
                    .await?;
            }
            Transport::IbexTcpTls => {
                let mut config = t.config()?;
                config.tls = Some(crate::transport::bench_tls::server().transport()?);
                let l = ibex_transport::listen(&listen, config).await?;
                announce(&l.local_uri())?;
                ibex_transport::grpc::Server::builder()
                    .add_service(svc)
                    .serve_with_listener(l, std::future::pending())
                    .await?;
            }
            // Through `serve_any`, which hands the same settings to stock tonic.
            Transport::TonicTls => {
                let port = tokio::net::TcpListener::bind(listen.trim_start_matches("https://"))
                    .await?
                    .local_addr()?;
                let server = ibex_transport::grpc::Server::builder()
                    .tls_config(crate::transport::bench_tls::server())?
                    .add_service(svc);
                let serving = tokio::spawn(async move {
                    server
                        .serve_any(&format!("https://{port}"), std::future::pending())
                        .await
                });
                // Announced once it accepts, so that the client's one connect finds it.
                while tokio::net::TcpStream::connect(port).await.is_err() && !serving.is_finished()
                {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                announce(&format!("https://{port}"))?;
                serving.await??;
            }
            Transport::RawShm | Transport::RawTcp => {
                let l = ibex_transport::listen(&listen, t.config()?).await?;
                announce(&l.local_uri())?;
                loop {
                    match l.accept().await {
                        Ok(c) => {
                            // Beside its driver: on its serve thread where it has one.
                            c.spawn(raw_peer(c.clone()));
                        }
                        Err(e) => eprintln!("ibex-bench server: accept failed: {e}"),
                    }
                }
            }
            Transport::RawShmTypes => {
                let l = ibex_transport::listen(&listen, t.config()?).await?;
                announce(&l.local_uri())?;
                let svc = Arc::new(Svc);
                loop {
                    match l.accept().await {
                        Ok(c) => {
                            c.spawn(typed_peer(c.clone(), svc.clone()));
                        }
                        Err(e) => eprintln!("ibex-bench server: accept failed: {e}"),
                    }
                }
            }
        }
        Ok(())
    })
}

/// The `raw-shm-types` peer: each message is a tag byte (Echo or Sink) and the request's
/// protobuf message, answered with a byte and the response's. Each call is given what a
/// tonic handler is given and answered as a gRPC server must answer it: the message
/// decoded into a `tonic::Request` with the request headers as its metadata and the
/// connection's extensions, the service's own handler called through its boxed future,
/// the `tonic::Response` taken apart and its message encoded. The headers and extensions
/// are clones of maps made once here, as a framing that cost nothing would give them; the
/// extensions hold what `ibex-shm`'s do (`ConnectInfo` and a handle on the connection).
async fn typed_peer(conn: Connection, svc: Arc<Svc>) {
    #[derive(Clone)]
    struct Peer {
        _conn: Connection,
        _id: u64,
    }
    let mut headers = http::HeaderMap::new();
    headers.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    headers.insert(
        http::header::USER_AGENT,
        http::HeaderValue::from_static("tonic/0.14 ibex/0.1.0 (shm)"),
    );
    let mut extensions = http::Extensions::new();
    let peer = conn.peer();
    extensions.insert(ibex_transport::grpc::ConnectInfo {
        provider: conn.provider(),
        remote_addr: None,
        peer_pid: None,
        peer_uid: None,
        peer: peer.into(),
    });
    extensions.insert(Peer {
        _conn: conn.clone(),
        _id: 1,
    });
    while let Ok(mut m) = conn.recv().await {
        let tag = m.first().copied();
        if !m.is_empty() {
            m.advance(1);
        }
        let metadata = MetadataMap::from_headers(headers.clone());
        let answer = match tag {
            Some(RAW_ECHO) => typed_answer(m, metadata, extensions.clone(), |r| svc.echo(r)).await,
            Some(RAW_SINK) => typed_answer(m, metadata, extensions.clone(), |r| svc.sink(r)).await,
            _ => Err("a message without an echo/sink tag".to_string()),
        };
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                eprintln!("ibex-bench server: raw-shm-types: {e}; closing that connection");
                break;
            }
        };
        if conn.send(answer).await.is_err() {
            break;
        }
    }
    conn.close().await;
}

/// One `raw-shm-types` call: `msg` decoded, handed to `handler` with `metadata` and
/// `extensions`, its answer encoded behind a byte.
async fn typed_answer<Q, A, F>(
    msg: Bytes,
    metadata: MetadataMap,
    extensions: http::Extensions,
    handler: impl FnOnce(Request<Q>) -> F,
) -> Result<Bytes, String>
where
    Q: prost::Message + Default,
    A: prost::Message,
    F: std::future::Future<Output = Result<Response<A>, Status>>,
{
    let msg = Q::decode(msg).map_err(|e| format!("a malformed request: {e}"))?;
    let request = Request::from_parts(metadata, extensions, msg);
    let response = handler(request)
        .await
        .map_err(|s| format!("the handler failed: {s}"))?;
    let (metadata, msg, extensions) = response.into_parts();
    let mut buf = BytesMut::with_capacity(1 + msg.encoded_len());
    buf.put_u8(RAW_ECHO);
    msg.encode(&mut buf)
        .map_err(|e| format!("the answer could not be encoded: {e}"))?;
    drop((metadata, msg, extensions));
    Ok(buf.freeze())
}

/// The raw-transport peer: echo or acknowledge by the first byte, until the client leaves.
async fn raw_peer(conn: Connection) {
    while let Ok(m) = conn.recv().await {
        let reply = match m.first() {
            Some(&RAW_ECHO) => m,
            Some(&RAW_SINK) => Bytes::from_static(&[RAW_SINK]),
            _ => {
                eprintln!(
                    "ibex-bench server: raw message without an echo/sink tag; closing that connection"
                );
                break;
            }
        };
        if conn.send(reply).await.is_err() {
            break;
        }
    }
    conn.close().await;
}
