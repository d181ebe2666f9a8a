//! The `Bench` service the conformance cases call. Behaviour is steered per call by the
//! `x-mode` request header, so one service covers every case:
//! - absent: normal behaviour;
//! - `fail`: answer at once with an error carrying details and metadata (trailers-only);
//! - `fail-after:N` (Stream): send N messages, then the error (status in trailers);
//! - `sleep:MS`: report the start, sleep, then answer normally;
//! - `hold`: report the start and never answer (until the call is cancelled).
//!
//! Every handler reports `Started` when it begins and `Cancelled` if its future is dropped
//! before it finished, which is how the tests observe cancellation and deadlines server-side.

use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use ibex_proto::bench::v1::bench_ibex::{Bench, BenchServer};
use ibex_proto::bench::v1::{Ack, Payload, StreamRequest};
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};
use tonic::metadata::{KeyAndValueRef, MetadataMap};
use tonic::{Code, Request, Response, Status, Streaming};

use super::pattern;

/// What a handler reports about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The handler began (method name).
    Started(&'static str),
    /// The handler's future was dropped before it finished (method name).
    Cancelled(&'static str),
    /// A task the handler spawned read the request stream to its end: `Ok(messages)` for a
    /// clean end, `Err(code)` for an error (`upload` with `x-mode: spawn-read`).
    StreamEnd(Result<u32, Code>),
}

/// The receiving end of the handler reports.
pub type Events = mpsc::UnboundedReceiver<Event>;

/// The test implementation of `ibex.bench.v1.Bench`.
#[derive(Clone)]
pub struct BenchImpl {
    events: mpsc::UnboundedSender<Event>,
}

/// The details blob the failing handlers attach (binary, with a NUL and high bytes).
pub const ERROR_DETAILS: &[u8] = b"\x00details\xff\x01";
/// The message the failing handlers use (non-ASCII, so percent-encoding is exercised).
pub const ERROR_MESSAGE: &str = "bad payload: ünïcode & spaces";

impl BenchImpl {
    /// A service and the receiver of its handlers' reports.
    pub fn new() -> (BenchImpl, Events) {
        let (tx, rx) = mpsc::unbounded_channel();
        (BenchImpl { events: tx }, rx)
    }

    /// The service with message size limits (`None` keeps tonic's defaults: 4 MiB decode,
    /// unlimited encode), as ibex-codegen generates it (`into_tonic` gives tonic's).
    pub fn server(
        self,
        max_decode: Option<usize>,
        max_encode: Option<usize>,
    ) -> BenchServer<BenchImpl> {
        let mut s = BenchServer::new(self);
        if let Some(n) = max_decode {
            s = s.max_decoding_message_size(n);
        }
        if let Some(n) = max_encode {
            s = s.max_encoding_message_size(n);
        }
        s
    }

    fn guard(&self, method: &'static str) -> Guard {
        let _ = self.events.send(Event::Started(method));
        Guard {
            method,
            events: self.events.clone(),
            done: false,
        }
    }
}

/// Reports `Cancelled` if dropped before `finish`.
struct Guard {
    method: &'static str,
    events: mpsc::UnboundedSender<Event>,
    done: bool,
}

impl Guard {
    fn finish(mut self) {
        self.done = true;
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.events.send(Event::Cancelled(self.method));
        }
    }
}

fn mode<T>(req: &Request<T>) -> String {
    req.metadata()
        .get("x-mode")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// The error every failing handler returns: details plus one ascii and one binary entry.
pub fn test_error() -> Status {
    let mut md = MetadataMap::new();
    md.insert("x-error-ascii", "why".parse().unwrap());
    md.insert_bin(
        "x-error-bin",
        tonic::metadata::MetadataValue::from_bytes(b"\x00\xfe"),
    );
    Status::with_details_and_metadata(
        Code::InvalidArgument,
        ERROR_MESSAGE,
        Bytes::from_static(ERROR_DETAILS),
        md,
    )
}

/// Applies the common modes; `Ok(())` means carry on normally.
async fn common_mode(mode: &str) -> Result<(), Status> {
    if mode == "fail" {
        return Err(test_error());
    }
    if let Some(ms) = mode.strip_prefix("sleep:") {
        let ms: u64 = ms
            .parse()
            .map_err(|_| Status::invalid_argument("bad sleep"))?;
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if mode == "hold" {
        std::future::pending::<()>().await;
    }
    if mode == "panic" {
        panic!("handler panics on purpose (x-mode: panic)");
    }
    Ok(())
}

/// Copies every `x-` request entry into `out` as `echo-x-...`, ascii and binary alike.
fn echo_metadata(from: &MetadataMap, out: &mut MetadataMap) {
    for kv in from.iter() {
        match kv {
            KeyAndValueRef::Ascii(k, v)
                if k.as_str().starts_with("x-") && k.as_str() != "x-mode" =>
            {
                out.insert(
                    tonic::metadata::AsciiMetadataKey::from_bytes(
                        format!("echo-{}", k.as_str()).as_bytes(),
                    )
                    .unwrap(),
                    v.clone(),
                );
            }
            KeyAndValueRef::Binary(k, v) if k.as_str().starts_with("x-") => {
                out.insert_bin(
                    tonic::metadata::BinaryMetadataKey::from_bytes(
                        format!("echo-{}", k.as_str()).as_bytes(),
                    )
                    .unwrap(),
                    v.clone(),
                );
            }
            _ => {}
        }
    }
}

type PayloadStream = Pin<Box<dyn Stream<Item = Result<Payload, Status>> + Send>>;

#[tonic::async_trait]
impl Bench for BenchImpl {
    async fn echo(&self, req: Request<Payload>) -> Result<Response<Payload>, Status> {
        if mode(&req) == "whoami" {
            // Says what the handler can learn about its caller.
            let mut resp = Response::new(Payload::default());
            let md = resp.metadata_mut();
            if let Some(a) = req.remote_addr() {
                md.insert("x-remote-addr", a.to_string().parse().unwrap());
            }
            if let Some(ua) = req.metadata().get("user-agent") {
                md.insert("x-user-agent", ua.clone());
            }
            if let Some(a) = req.local_addr() {
                md.insert("x-local-addr", a.to_string().parse().unwrap());
            }
            // tonic's view of the client's TLS certificates: the leaf's length and count.
            if let Some(certs) = req.peer_certs() {
                md.insert("x-peer-certs", certs.len().to_string().parse().unwrap());
                md.insert(
                    "x-peer-cert-len",
                    certs[0].len().to_string().parse().unwrap(),
                );
            }
            for (from, to) in [("te", "x-te"), ("content-type", "x-content-type")] {
                if let Some(v) = req.metadata().get(from) {
                    md.insert(to, v.clone());
                }
            }
            if let Some(i) = req.extensions().get::<ibex_transport::grpc::ConnectInfo>() {
                md.insert("x-provider", i.provider.parse().unwrap());
                if let Some(pid) = i.peer_pid {
                    md.insert("x-peer-pid", pid.to_string().parse().unwrap());
                }
                if let Some(uid) = i.peer_uid {
                    md.insert("x-peer-uid", uid.to_string().parse().unwrap());
                }
            }
            return Ok(resp);
        }
        if mode(&req) == "runtime" {
            // Where the handler runs, and where what it spawns runs; it also blocks the way
            // tokio allows on a multi-thread runtime.
            let name = || std::thread::current().name().unwrap_or("").to_owned();
            let handler = tokio::task::block_in_place(name);
            let spawned = tokio::spawn(async move { name() })
                .await
                .map_err(|e| Status::internal(format!("spawned task failed: {e}")))?;
            let mut resp = Response::new(Payload::default());
            let md = resp.metadata_mut();
            md.insert("x-handler-thread", handler.parse().unwrap());
            md.insert("x-spawned-thread", spawned.parse().unwrap());
            return Ok(resp);
        }
        let guard = self.guard("echo");
        let mode = mode(&req);
        common_mode(&mode).await?;
        let mut md = MetadataMap::new();
        echo_metadata(req.metadata(), &mut md);
        let payload = if mode == "pull" {
            let (p, one_sided) = super::transports::pull(&req).await?;
            md.insert(
                "x-one-sided",
                if one_sided { "true" } else { "false" }.parse().unwrap(),
            );
            p
        } else {
            req.into_inner()
        };
        let mut resp = Response::new(payload);
        *resp.metadata_mut() = md;
        guard.finish();
        Ok(resp)
    }

    async fn sink(&self, req: Request<Payload>) -> Result<Response<Ack>, Status> {
        let guard = self.guard("sink");
        common_mode(&mode(&req)).await?;
        let p = req.into_inner();
        guard.finish();
        Ok(Response::new(Ack {
            bytes: p.buffers.iter().map(|b| b.len() as u64).sum(),
            buffers: p.buffers.len() as u32,
        }))
    }

    type StreamStream = PayloadStream;

    async fn stream(&self, req: Request<StreamRequest>) -> Result<Response<PayloadStream>, Status> {
        let guard = self.guard("stream");
        let mode = mode(&req);
        common_mode(&mode).await?;
        let fail_after: Option<u32> = mode
            .strip_prefix("fail-after:")
            .and_then(|n| n.parse().ok());
        let r = req.into_inner();
        let size = r.payload_size as usize;
        let count = r.count;
        // A status ends the stream: nothing follows the error.
        let n = fail_after.map_or(count, |f| (f + 1).min(count));
        let s = tokio_stream::iter(0..n).map(move |i| {
            if Some(i) == fail_after {
                Err(test_error())
            } else {
                Ok(Payload {
                    buffers: vec![pattern(size, i as u8)],
                })
            }
        });
        guard.finish();
        Ok(Response::new(Box::pin(s)))
    }

    type ChatStream = PayloadStream;

    async fn chat(
        &self,
        req: Request<Streaming<Payload>>,
    ) -> Result<Response<PayloadStream>, Status> {
        let guard = self.guard("chat");
        common_mode(&mode(&req)).await?;
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            while let Some(m) = inbound.next().await {
                let done = m.is_err();
                if tx.send(m).await.is_err() || done {
                    break;
                }
            }
        });
        guard.finish();
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn upload(&self, req: Request<Streaming<Payload>>) -> Result<Response<Ack>, Status> {
        let guard = self.guard("upload");
        let m = mode(&req);
        if m == "spawn-read" {
            // An uploader that reads on its own task and commits at a clean end: it must
            // learn of a client that went away as an error, never as the end of its data.
            let mut inbound = req.into_inner();
            let events = self.events.clone();
            tokio::spawn(async move {
                let mut n = 0;
                let end = loop {
                    match inbound.message().await {
                        Ok(Some(_)) => n += 1,
                        Ok(None) => break Ok(n),
                        Err(e) => break Err(e.code()),
                    }
                };
                let _ = events.send(Event::StreamEnd(end));
            });
            return std::future::pending().await;
        }
        common_mode(&m).await?;
        let mut inbound = req.into_inner();
        let mut ack = Ack::default();
        while let Some(p) = inbound.message().await? {
            ack.bytes += p.buffers.iter().map(|b| b.len() as u64).sum::<u64>();
            ack.buffers += p.buffers.len() as u32;
        }
        guard.finish();
        Ok(Response::new(ack))
    }
}
