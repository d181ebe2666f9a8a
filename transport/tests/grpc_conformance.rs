//! gRPC conformance: one set of cases, run over every transport. Stock tonic (HTTP/2 over
//! TCP) is the reference; the Ibex transports must behave the same from the application's
//! point of view (codes, messages, details, metadata, limits, cancellation, shutdown).

mod grpc_common;

use std::future::Future;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use grpc_common::service::{ERROR_DETAILS, ERROR_MESSAGE, Event};
use grpc_common::transports::{
    IbexShm, IbexShmHomes, IbexTcp, IbexTcpTls, Services, Stock, TonicTls,
};
use grpc_common::{BenchImpl, Chan, Events, ServerHandle, Transport, pattern};
use http_body_util::BodyExt;
use ibex_proto::bench::v1::bench_client::BenchClient;
use ibex_proto::bench::v1::{Ack, Payload, StreamRequest};
use prost::Message;
use tonic::service::Routes;
use tonic::{Code, Request, Status};
use tower::ServiceExt;

const MIB: usize = 1 << 20;

/// Guards against hangs only (a hang is a failure); never a performance assertion. The
/// Soft-RoCE VM runs under full emulation (10–100× slower), so its harness raises the guard
/// with `IBEX_TEST_GUARD_SECS`.
async fn within<F: Future>(f: F) -> F::Output {
    let secs = std::env::var("IBEX_TEST_GUARD_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("test hung for {secs} s"))
}

/// The next handler event, failing instead of hanging.
async fn next_event(ev: &mut Events) -> Event {
    tokio::time::timeout(Duration::from_secs(20), ev.recv())
        .await
        .expect("no handler event within 20 s")
        .expect("service dropped")
}

async fn start<T: Transport>(
    max_decode: Option<usize>,
    max_encode: Option<usize>,
) -> (ServerHandle, Events) {
    let (svc, ev) = BenchImpl::new();
    (
        T::serve(Services::new(svc.server(max_decode, max_encode))).await,
        ev,
    )
}

async fn client<T: Transport>(srv: &ServerHandle) -> BenchClient<Chan> {
    BenchClient::new(T::connect(&srv.addr).await.unwrap())
}

fn with_mode<M>(msg: M, mode: &str) -> Request<M> {
    let mut r = Request::new(msg);
    r.metadata_mut().insert("x-mode", mode.parse().unwrap());
    r
}

fn assert_test_error(s: &Status) {
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert_eq!(s.message(), ERROR_MESSAGE);
    assert_eq!(s.details(), ERROR_DETAILS);
    assert_eq!(s.metadata().get("x-error-ascii").unwrap(), "why");
    assert_eq!(
        s.metadata()
            .get_bin("x-error-bin")
            .unwrap()
            .to_bytes()
            .unwrap()
            .as_ref(),
        b"\x00\xfe"
    );
}

mod cases {
    use super::*;

    pub async fn unary<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let bufs = vec![pattern(100, 1), Bytes::new(), pattern(3000, 2)];
        let r = c
            .echo(Payload {
                buffers: bufs.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.buffers, bufs);
        let ack = c
            .sink(Payload { buffers: bufs })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            ack,
            Ack {
                bytes: 3100,
                buffers: 3
            }
        );
        srv.shutdown().await.unwrap();
    }

    pub async fn server_streaming<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let mut s = c
            .stream(StreamRequest {
                count: 5,
                payload_size: 1000,
            })
            .await
            .unwrap()
            .into_inner();
        for i in 0..5u8 {
            let p = s.message().await.unwrap().expect("stream ended early");
            assert_eq!(p.buffers, vec![pattern(1000, i)]);
        }
        assert!(s.message().await.unwrap().is_none());
        let mut empty = c
            .stream(StreamRequest {
                count: 0,
                payload_size: 1,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(empty.message().await.unwrap().is_none());
        srv.shutdown().await.unwrap();
    }

    pub async fn client_streaming<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let msgs: Vec<Payload> = (0..10)
            .map(|i| Payload {
                buffers: vec![pattern(i * 100, i as u8); 2],
            })
            .collect();
        let ack = c
            .upload(tokio_stream::iter(msgs))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            ack,
            Ack {
                bytes: 2 * 100 * 45,
                buffers: 20
            }
        );
        let ack = c
            .upload(tokio_stream::iter(Vec::<Payload>::new()))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            ack,
            Ack {
                bytes: 0,
                buffers: 0
            }
        );
        srv.shutdown().await.unwrap();
    }

    pub async fn bidi_streaming<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let mut replies = c
            .chat(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        // Lock-step: each reply must arrive before the next request is sent, which proves the
        // transport delivers messages as they come rather than at half-close.
        for i in 0..20u8 {
            let p = Payload {
                buffers: vec![pattern(64 * i as usize, i)],
            };
            tx.send(p.clone()).await.unwrap();
            assert_eq!(
                replies.message().await.unwrap().expect("chat ended early"),
                p
            );
        }
        drop(tx);
        assert!(replies.message().await.unwrap().is_none());
        srv.shutdown().await.unwrap();
    }

    pub async fn error_details<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let e = c
            .echo(with_mode(Payload::default(), "fail"))
            .await
            .unwrap_err();
        assert_test_error(&e);
        // An error after messages arrives in the trailers.
        let mut s = c
            .stream(with_mode(
                StreamRequest {
                    count: 5,
                    payload_size: 10,
                },
                "fail-after:2",
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            s.message().await.unwrap().unwrap().buffers,
            vec![pattern(10, 0)]
        );
        assert_eq!(
            s.message().await.unwrap().unwrap().buffers,
            vec![pattern(10, 1)]
        );
        assert_test_error(&s.message().await.unwrap_err());
        // Client-streaming and bidi errors too.
        let e = c
            .upload(with_mode(
                tokio_stream::iter(vec![Payload::default()]),
                "fail",
            ))
            .await
            .unwrap_err();
        assert_test_error(&e);
        let e = c
            .chat(with_mode(
                tokio_stream::iter(vec![Payload::default()]),
                "fail",
            ))
            .await
            .unwrap_err();
        assert_test_error(&e);
        srv.shutdown().await.unwrap();
    }

    /// Raw HTTP view of one call through the channel: response head, data frames, trailers.
    async fn raw_call(
        chan: &Chan,
        path: &'static str,
        mode: &str,
        msg: impl Message,
    ) -> (http::response::Parts, Vec<Bytes>, Option<http::HeaderMap>) {
        let body = msg.encode_to_vec();
        let mut framed = BytesMut::with_capacity(5 + body.len());
        framed.put_u8(0);
        framed.put_u32(body.len() as u32);
        framed.put_slice(&body);
        let req = http::Request::builder()
            .method("POST")
            .uri(path)
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("x-mode", mode)
            .body(tonic::body::Body::new(http_body_util::Full::new(
                framed.freeze(),
            )))
            .unwrap();
        let resp = chan.clone().oneshot(req).await.unwrap();
        let (parts, mut body) = resp.into_parts();
        let (mut data, mut trailers) = (Vec::new(), None);
        while let Some(f) = body.frame().await {
            let f = f.unwrap();
            match f.into_data() {
                Ok(d) => data.push(d),
                Err(f) => trailers = Some(f.into_trailers().unwrap()),
            }
        }
        (parts, data, trailers)
    }

    pub async fn trailers_only<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let chan = T::connect(&srv.addr).await.unwrap();
        // Immediate error: grpc-status in the response headers, no body, no trailers.
        let (head, data, trailers) = raw_call(
            &chan,
            "/ibex.bench.v1.Bench/Echo",
            "fail",
            Payload::default(),
        )
        .await;
        assert_eq!(head.status, 200);
        assert_eq!(head.headers.get("grpc-status").unwrap(), "3");
        assert!(
            head.headers
                .get("grpc-message")
                .unwrap()
                .to_str()
                .unwrap()
                .contains("bad%20payload")
        );
        assert!(head.headers.get("grpc-status-details-bin").is_some());
        assert_eq!(head.headers.get("x-error-ascii").unwrap(), "why");
        assert!(
            data.iter().all(|d| d.is_empty()),
            "trailers-only response had data"
        );
        assert!(
            trailers.is_none(),
            "trailers-only response had trailers: {trailers:?}"
        );
        // A successful call: data, then grpc-status 0 in the trailers, not in the headers.
        let p = Payload {
            buffers: vec![pattern(77, 7)],
        };
        let (head, data, trailers) =
            raw_call(&chan, "/ibex.bench.v1.Bench/Echo", "", p.clone()).await;
        assert!(head.headers.get("grpc-status").is_none());
        assert_eq!(
            head.headers.get("content-type").unwrap(),
            "application/grpc"
        );
        let mut all: Bytes = data.concat().into();
        assert_eq!(all.get_u8(), 0);
        let len = all.get_u32() as usize;
        assert_eq!(len, all.len());
        assert_eq!(Payload::decode(all).unwrap(), p);
        assert_eq!(trailers.unwrap().get("grpc-status").unwrap(), "0");
        // An error after a message: the status in the trailers.
        let (head, data, trailers) = raw_call(
            &chan,
            "/ibex.bench.v1.Bench/Stream",
            "fail-after:1",
            StreamRequest {
                count: 3,
                payload_size: 5,
            },
        )
        .await;
        assert!(head.headers.get("grpc-status").is_none());
        assert!(!data.concat().is_empty());
        let t = trailers.unwrap();
        assert_eq!(t.get("grpc-status").unwrap(), "3");
        assert_eq!(t.get("x-error-ascii").unwrap(), "why");
        // Unknown method: tonic's router answers Unimplemented, trailers-only.
        let (head, _, _) =
            raw_call(&chan, "/ibex.bench.v1.Bench/Nope", "", Payload::default()).await;
        assert_eq!(head.headers.get("grpc-status").unwrap(), "12");
        // Unknown service: the router's fallback, the same answer.
        let (head, _, _) = raw_call(&chan, "/no.Such/Method", "", Payload::default()).await;
        assert_eq!(head.headers.get("grpc-status").unwrap(), "12");
        srv.shutdown().await.unwrap();
    }

    pub async fn metadata<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let mut req = Request::new(Payload::default());
        req.metadata_mut()
            .insert("x-ascii", "hello world".parse().unwrap());
        req.metadata_mut().append("x-multi", "one".parse().unwrap());
        req.metadata_mut().insert_bin(
            "x-data-bin",
            tonic::metadata::MetadataValue::from_bytes(&[0, 1, 2, 255, 10, 13]),
        );
        let resp = c.echo(req).await.unwrap();
        let md = resp.metadata();
        assert_eq!(md.get("echo-x-ascii").unwrap(), "hello world");
        assert_eq!(md.get("echo-x-multi").unwrap(), "one");
        assert_eq!(
            md.get_bin("echo-x-data-bin")
                .unwrap()
                .to_bytes()
                .unwrap()
                .as_ref(),
            &[0, 1, 2, 255, 10, 13]
        );
        srv.shutdown().await.unwrap();
    }

    pub async fn deadline<T: Transport>() {
        let (srv, mut ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let mut req = with_mode(Payload::default(), "sleep:30000");
        // Long enough for the request to reach the server and its handler to start on a
        // loaded machine: the check is that the server cancels a started handler.
        req.set_timeout(Duration::from_secs(1));
        let e = c.echo(req).await.unwrap_err();
        assert_eq!(e.code(), T::DEADLINE_CODE, "{e:?}");
        // The server gives up on the handler too.
        assert_eq!(next_event(&mut ev).await, Event::Started("echo"));
        assert_eq!(next_event(&mut ev).await, Event::Cancelled("echo"));
        // A deadline that is met changes nothing.
        let mut req = with_mode(
            Payload {
                buffers: vec![pattern(10, 3)],
            },
            "sleep:10",
        );
        req.set_timeout(Duration::from_secs(30));
        assert_eq!(
            c.echo(req).await.unwrap().into_inner().buffers,
            vec![pattern(10, 3)]
        );
        srv.shutdown().await.unwrap();
    }

    pub async fn client_cancel<T: Transport>() {
        let (srv, mut ev) = start::<T>(None, None).await;
        let c = client::<T>(&srv).await;
        let mut c1 = c.clone();
        let call =
            tokio::spawn(async move { c1.echo(with_mode(Payload::default(), "hold")).await });
        assert_eq!(next_event(&mut ev).await, Event::Started("echo"));
        call.abort();
        assert!(call.await.unwrap_err().is_cancelled());
        assert_eq!(next_event(&mut ev).await, Event::Cancelled("echo"));
        // Streaming: the client drops the response stream mid-way; the channel stays usable.
        let mut c2 = c.clone();
        let mut s = c2
            .stream(StreamRequest {
                count: 1000,
                payload_size: 64 * 1024,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(s.message().await.unwrap().is_some());
        drop(s);
        let mut c3 = c.clone();
        assert_eq!(
            c3.echo(Payload {
                buffers: vec![pattern(5, 5)]
            })
            .await
            .unwrap()
            .into_inner()
            .buffers,
            vec![pattern(5, 5)]
        );
        srv.shutdown().await.unwrap();
    }

    /// A client that drops a client-streaming call mid-stream: a task the handler spawned to
    /// read the request stream sees an error, never a clean end (an uploader that commits at
    /// the end would commit truncated data).
    pub async fn client_abort_is_an_error<T: Transport>() {
        let (srv, mut ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let (tx, rx) = tokio::sync::mpsc::channel::<Payload>(4);
        let req = with_mode(
            tokio_stream::wrappers::ReceiverStream::new(rx),
            "spawn-read",
        );
        let call = tokio::spawn(async move { c.upload(req).await });
        assert_eq!(next_event(&mut ev).await, Event::Started("upload"));
        for i in 0..2u8 {
            tx.send(Payload {
                buffers: vec![pattern(1000, i)],
            })
            .await
            .unwrap();
        }
        // Let the two messages reach the server before the call goes away.
        tokio::time::sleep(Duration::from_millis(100)).await;
        call.abort();
        let _ = call.await;
        loop {
            match next_event(&mut ev).await {
                Event::StreamEnd(end) => {
                    assert!(end.is_err(), "the reader saw a clean end: {end:?}");
                    break;
                }
                Event::Cancelled("upload") => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        drop(tx);
        srv.shutdown().await.unwrap();
    }

    pub async fn message_sizes<T: Transport>() {
        let (srv, _ev) = start::<T>(Some(usize::MAX), None).await;
        let mut c = client::<T>(&srv)
            .await
            .max_decoding_message_size(usize::MAX);
        for (len, seed) in [(0, 0), (4 * MIB, 1), (64 * MIB, 2)] {
            let p = Payload {
                buffers: vec![pattern(len, seed)],
            };
            let r = c.echo(p.clone()).await.unwrap().into_inner();
            assert_eq!(r.buffers.len(), 1);
            assert_eq!(r.buffers[0].len(), len);
            assert!(r == p, "{len}-byte echo came back different");
        }
        let ack = c
            .upload(tokio_stream::iter(vec![
                Payload {
                    buffers: vec![pattern(4 * MIB, 9)]
                };
                3
            ]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            ack,
            Ack {
                bytes: 12 * MIB as u64,
                buffers: 3
            }
        );
        srv.shutdown().await.unwrap();
    }

    pub async fn size_limits<T: Transport>() {
        // tonic's defaults: 4 MiB decoding limit on both sides, encoding unlimited.
        let (srv, _ev) = start::<T>(None, Some(MIB)).await;
        let mut c = client::<T>(&srv).await;
        // Request over the server's decoding limit.
        let e = c
            .echo(Payload {
                buffers: vec![pattern(5 * MIB, 1)],
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
        assert!(
            e.message().contains("decoded message length too large"),
            "{e:?}"
        );
        // Response over the server's encoding limit (1 MiB here).
        let mut s = c
            .stream(StreamRequest {
                count: 1,
                payload_size: 2 * MIB as u64,
            })
            .await
            .unwrap()
            .into_inner();
        let e = s.message().await.unwrap_err();
        assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
        assert!(
            e.message().contains("encoded message length too large"),
            "{e:?}"
        );
        // Response over the client's decoding limit.
        let mut c = c.max_decoding_message_size(MIB / 2);
        let mut s = c
            .stream(StreamRequest {
                count: 1,
                payload_size: (MIB / 2) as u64 + 1,
            })
            .await
            .unwrap()
            .into_inner();
        let e = s.message().await.unwrap_err();
        assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
        assert!(
            e.message().contains("decoded message length too large"),
            "{e:?}"
        );
        // The channel is fine afterwards.
        assert_eq!(
            c.echo(Payload {
                buffers: vec![pattern(10, 4)]
            })
            .await
            .unwrap()
            .into_inner()
            .buffers,
            vec![pattern(10, 4)]
        );
        srv.shutdown().await.unwrap();
    }

    pub async fn concurrent_calls<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let c = client::<T>(&srv).await;
        let calls: Vec<_> = (0..1000u32)
            .map(|i| {
                let mut c = c.clone();
                tokio::spawn(async move {
                    let p = Payload {
                        buffers: vec![
                            Bytes::from(i.to_le_bytes().to_vec()),
                            pattern((i % 7) as usize * 100, i as u8),
                        ],
                    };
                    let r = c.echo(p.clone()).await.unwrap().into_inner();
                    assert_eq!(r, p, "call {i} got another call's reply");
                })
            })
            .collect();
        for call in calls {
            call.await.unwrap();
        }
        srv.shutdown().await.unwrap();
    }

    /// A handler may `block_in_place`, and what it spawns runs on the server's runtime,
    /// on serve threads too (which run the handler itself).
    pub async fn handler_runtime<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let r = c
            .echo(with_mode(Payload::default(), "runtime"))
            .await
            .unwrap();
        let thread = |k: &str| r.metadata().get(k).unwrap().to_str().unwrap().to_owned();
        let (handler, spawned) = (thread("x-handler-thread"), thread("x-spawned-thread"));
        // (Only where the suite asks for serve threads: the environment may add them to
        // the others, as `IBEX_BUSY_POLL=1` does.)
        if T::HOMED {
            assert!(handler.starts_with("ibex-serve-"), "{handler}");
        }
        assert!(!spawned.starts_with("ibex-serve-"), "{spawned}");
        srv.shutdown().await.unwrap();
    }

    /// A handler that panics fails its own call, not the connection or the server.
    pub async fn handler_panic<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let e = c
            .echo(with_mode(Payload::default(), "panic"))
            .await
            .unwrap_err();
        // tonic: the HTTP/2 stream is reset (CANCEL), which its client reports as Cancelled.
        assert_eq!(e.code(), Code::Cancelled, "{e:?}");
        let p = Payload {
            buffers: vec![pattern(10, 6)],
        };
        assert_eq!(c.echo(p.clone()).await.unwrap().into_inner(), p);
        srv.shutdown().await.unwrap();
    }

    /// Flow control is per call: a reader that stops consuming one stream holds up neither
    /// the connection nor the other calls on it.
    pub async fn slow_reader<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let c = client::<T>(&srv).await;
        let mut c1 = c.clone();
        let mut stalled = c1
            .stream(StreamRequest {
                count: 48,
                payload_size: MIB as u64,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(stalled.message().await.unwrap().unwrap().buffers == vec![pattern(MIB, 0)]);
        // The server now has more in flight than any window allows; other calls still go.
        for i in 0..20u8 {
            let mut c2 = c.clone();
            let p = Payload {
                buffers: vec![pattern(1000, i)],
            };
            assert_eq!(c2.echo(p.clone()).await.unwrap().into_inner(), p);
        }
        for i in 1..48u8 {
            let m = stalled
                .message()
                .await
                .unwrap()
                .expect("stream ended early");
            assert!(
                m.buffers == vec![pattern(MIB, i)],
                "stream message {i} differs"
            );
        }
        assert!(stalled.message().await.unwrap().is_none());
        srv.shutdown().await.unwrap();
    }

    pub async fn graceful_shutdown<T: Transport>() {
        let (mut srv, mut ev) = start::<T>(None, None).await;
        let c = client::<T>(&srv).await;
        let calls: Vec<_> = (0..10u8)
            .map(|i| {
                let mut c = c.clone();
                tokio::spawn(async move {
                    c.echo(with_mode(
                        Payload {
                            buffers: vec![pattern(100, i)],
                        },
                        "sleep:300",
                    ))
                    .await
                })
            })
            .collect();
        for _ in 0..10 {
            assert_eq!(next_event(&mut ev).await, Event::Started("echo"));
        }
        srv.trigger_shutdown();
        for (i, call) in calls.into_iter().enumerate() {
            let r = call
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("in-flight call {i} failed on shutdown: {e:?}"));
            assert_eq!(r.into_inner().buffers, vec![pattern(100, i as u8)]);
        }
        srv.join().await.unwrap();
        assert_gone::<T>(&mut c.clone()).await;
    }

    /// A graceful shutdown whose connections are all idle ends at once: each connection's
    /// loop wakes for the shutdown itself, with no message or call to wake it.
    pub async fn graceful_shutdown_idle<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let r = c
            .echo(Payload {
                buffers: vec![pattern(10, 1)],
            })
            .await
            .unwrap();
        assert_eq!(r.into_inner().buffers, vec![pattern(10, 1)]);
        // A loop that sleeps through the shutdown hangs here, and `within` says so.
        srv.shutdown().await.unwrap();
        assert_gone::<T>(&mut c).await;
    }

    /// Calls to a server that is gone fail fast with `Unavailable` (the first one, on stock
    /// tonic, may race the closing connection: see `Transport::GONE_CODES`).
    async fn assert_gone<T: Transport>(c: &mut BenchClient<Chan>) {
        let e = c.echo(Payload::default()).await.unwrap_err();
        assert!(T::GONE_CODES.contains(&e.code()), "{e:?}");
        assert!(!e.message().is_empty());
        let e = c.echo(Payload::default()).await.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        assert!(!e.message().is_empty());
    }

    /// Interceptors on both sides, as production services use them, with tonic's own
    /// types: `BenchServer::with_interceptor` served as is, `BenchClient::with_interceptor`
    /// over the transport's channel. The server's refuses calls without the token; a
    /// client's that refuses never sends the call. Served as tonic `Routes`
    /// (`Builder::add_routes`), so this case covers the calls Ibex hands to tonic's router.
    pub async fn interceptors<T: Transport>() {
        use ibex_proto::bench::v1::bench_server::BenchServer;
        fn check_auth(req: Request<()>) -> Result<Request<()>, Status> {
            match req.metadata().get("authorization") {
                Some(t) if t == "Bearer secret" => Ok(req),
                _ => Err(Status::unauthenticated("no valid token")),
            }
        }
        let (svc, _ev) = BenchImpl::new();
        let srv = T::serve(Services::routes(Routes::new(
            BenchServer::with_interceptor(svc, check_auth),
        )))
        .await;
        let ch = T::connect(&srv.addr).await.unwrap();
        let mut plain = BenchClient::new(ch.clone());
        let e = plain.echo(Payload::default()).await.unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
        let mut authed = BenchClient::with_interceptor(ch.clone(), |mut req: Request<()>| {
            req.metadata_mut()
                .insert("authorization", "Bearer secret".parse().unwrap());
            Ok(req)
        });
        let bufs = vec![pattern(64, 3)];
        let r = authed
            .echo(Payload {
                buffers: bufs.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.buffers, bufs);
        let mut refusing = BenchClient::with_interceptor(ch.clone(), |_req: Request<()>| {
            Err(Status::permission_denied("not from this client"))
        });
        let e = refusing.echo(Payload::default()).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied);
        drop((plain, authed, refusing, ch));
        srv.shutdown().await.unwrap();
    }

    /// What a handler learns about its caller where stock tonic tells it too: the peer's
    /// address from `remote_addr()` over TCP-based transports (shm: the peer's pid), and
    /// tonic's user-agent.
    pub async fn connect_info<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        let r = c
            .echo(with_mode(Payload::default(), "whoami"))
            .await
            .unwrap();
        let md = r.metadata();
        let get = |k: &str| md.get(k).map(|v| v.to_str().unwrap().to_string());
        let ua = get("x-user-agent").expect("a user-agent");
        assert!(ua.starts_with("tonic/"), "{ua}");
        match get("x-provider").as_deref() {
            // Stock tonic (no Ibex connect info), tcp, verbs: the peer's socket address.
            None | Some("tcp") | Some("verbs") => {
                let a = get("x-remote-addr").expect("remote_addr()");
                assert!(a.parse::<std::net::SocketAddr>().is_ok(), "{a}");
            }
            Some("shm") => {
                assert_eq!(get("x-peer-pid"), Some(std::process::id().to_string()));
            }
            Some(other) => panic!("provider {other}"),
        }
        drop(c);
        srv.shutdown().await.unwrap();
    }

    /// A server restarts at the same address: the same client channel fails its calls
    /// while the server is gone (`Unavailable`, or what `GONE_CODES` allows first) and
    /// reaches the new server on a later call, as tonic's channel does.
    pub async fn reconnect<T: Transport>() {
        let (svc, _ev) = BenchImpl::new();
        let srv = T::serve(Services::new(svc.server(None, None))).await;
        let addr = srv.addr.clone();
        let mut c = BenchClient::new(T::connect(&addr).await.unwrap());
        assert!(c.echo(Payload::default()).await.is_ok());
        srv.shutdown().await.unwrap();
        let e = c.echo(Payload::default()).await.unwrap_err();
        assert!(T::GONE_CODES.contains(&e.code()), "{e:?}");
        let (svc, _ev) = BenchImpl::new();
        let srv = T::serve_at(&addr, Services::new(svc.server(None, None))).await;
        let want = vec![pattern(10, 1)];
        let mut attempts = 0;
        loop {
            match c
                .echo(Payload {
                    buffers: want.clone(),
                })
                .await
            {
                Ok(r) => {
                    assert_eq!(r.into_inner().buffers, want);
                    break;
                }
                Err(e) => {
                    assert!(
                        T::GONE_CODES.contains(&e.code()) || e.code() == Code::Unavailable,
                        "{e:?}"
                    );
                    attempts += 1;
                    assert!(
                        attempts < 250,
                        "no call reached the restarted server: {e:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        drop(c);
        srv.shutdown().await.unwrap();
    }

    pub async fn server_gone<T: Transport>() {
        let dead = T::dead_addr().await;
        let Err(e) = T::connect(&dead).await else {
            panic!("connected to nothing at {dead}")
        };
        assert!(!e.is_empty());
        let (srv, _ev) = start::<T>(None, None).await;
        let mut c = client::<T>(&srv).await;
        assert!(c.echo(Payload::default()).await.is_ok());
        srv.shutdown().await.unwrap();
        assert_gone::<T>(&mut c).await;
    }
}

macro_rules! suite {
    ($m:ident: $t:ty; $($case:ident),* $(,)?) => {
        mod $m {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    within(cases::$case::<$t>()).await
                }
            )*
        }
    };
}

/// The same cases for each transport.
macro_rules! conformance {
    ($($m:ident: $t:ty),* $(,)?) => {
        $(
            suite!($m: $t;
                unary, server_streaming, client_streaming, bidi_streaming, error_details,
                trailers_only, metadata, deadline, client_cancel, message_sizes, size_limits,
                concurrent_calls, slow_reader, handler_panic, handler_runtime, graceful_shutdown,
                graceful_shutdown_idle, server_gone, interceptors, connect_info, reconnect);
        )*
    };
}

conformance!(
    tonic_tcp: Stock,
    ibex_shm: IbexShm,
    ibex_shm_homes: IbexShmHomes,
    ibex_tcp: IbexTcp,
    ibex_tcp_tls: IbexTcpTls,
    tonic_tls: TonicTls,
);

/// Mutual TLS with tonic's API, over Ibex tcp and over stock HTTP/2: the handler sees the
/// client's certificate through tonic's `Request::peer_certs()`, and its socket addresses.
mod mutual_tls {
    use super::*;
    use grpc_common::transports::{tls_connect, tls_connect_any, tls_file, tls_serve_any};

    async fn peer_certs_reach_the_handler(scheme: &str) {
        let (svc, _ev) = BenchImpl::new();
        let port = ibex_test_support::free_port();
        let uri = format!("{scheme}://127.0.0.1:{port}");
        let srv = tls_serve_any(uri.clone(), Services::new(svc.server(None, None)), true).await;
        let mut c = BenchClient::new(tls_connect(&uri, true).await.unwrap());
        let r = c
            .echo(with_mode(Payload::default(), "whoami"))
            .await
            .unwrap();
        let md = r.metadata();
        let get = |k: &str| md.get(k).map(|v| v.to_str().unwrap().to_string());
        let client_der = rustls_pki_der(&tls_file("client.pem"));
        assert_eq!(get("x-peer-certs").as_deref(), Some("1"));
        assert_eq!(get("x-peer-cert-len"), Some(client_der.to_string()));
        let local = get("x-local-addr").expect("local_addr()");
        assert_eq!(local, format!("127.0.0.1:{port}"));
        // The same through `connect_any` with the client setting in `Config::tls`.
        let mut c2 = BenchClient::new(tls_connect_any(&uri, true).await.unwrap());
        let r = c2
            .echo(with_mode(Payload::default(), "whoami"))
            .await
            .unwrap();
        let certs = r
            .metadata()
            .get("x-peer-certs")
            .map(|v| v.to_str().unwrap().to_string());
        assert_eq!(certs.as_deref(), Some("1"));
        drop(c2);
        // Without a client certificate, no call gets through.
        match tls_connect(&uri, false).await {
            Err(_) => {}
            Ok(ch) => {
                let e = BenchClient::new(ch)
                    .echo(Payload::default())
                    .await
                    .unwrap_err();
                // Stock tonic reports the server's alert as `Unknown("transport error")`,
                // or as `Cancelled` when hyper has handed the call to the connection the
                // alert closed.
                assert!(
                    matches!(
                        e.code(),
                        Code::Unavailable | Code::Unknown | Code::Cancelled
                    ),
                    "{e:?}"
                );
            }
        }
        drop(c);
        srv.shutdown().await.unwrap();
    }

    /// The DER length of the first certificate in `pem`.
    fn rustls_pki_der(pem: &[u8]) -> usize {
        use ibex_transport::tls::rustls::pki_types::{CertificateDer, pem::PemObject};
        CertificateDer::pem_slice_iter(pem)
            .next()
            .unwrap()
            .unwrap()
            .len()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ibex_tcp() {
        within(peer_certs_reach_the_handler("tcp")).await
    }

    /// TLS settings on the builder and a listener made without them: an error, never a
    /// server in clear.
    #[tokio::test]
    async fn a_plain_listener_is_not_served_when_tls_is_asked_for() {
        let l = ibex_transport::listen("tcp://127.0.0.1:0", ibex_transport::Config::default())
            .await
            .unwrap();
        let e = ibex_transport::grpc::Server::builder()
            .tls_config(grpc_common::transports::server_tls(false))
            .unwrap()
            .serve_with_listener(l, std::future::pending())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("made without TLS"), "{e}");
        // And settings that cannot work are refused when given.
        let e = ibex_transport::grpc::Server::builder()
            .tls_config(ibex_transport::grpc::ServerTlsConfig::new())
            .unwrap_err();
        assert!(e.to_string().contains("has no identity"), "{e}");
        let Err(e) = ibex_transport::grpc::Endpoint::from_static("tcp://127.0.0.1:1")
            .tls_config(ibex_transport::grpc::ClientTlsConfig::new().with_webpki_roots())
        else {
            panic!("webpki roots are not built in");
        };
        assert!(e.to_string().contains("ca_certificate"), "{e}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tonic_https() {
        within(peer_certs_reach_the_handler("https")).await
    }
}

// Where Ibex is deliberately stricter than stock tonic 0.14, whose decoder reports a client's
// RST_STREAM(CANCEL) as a clean end of the request stream (docs/grpc.md).
suite!(ibex_shm_strict: IbexShm; client_abort_is_an_error);
suite!(ibex_tcp_strict: IbexTcp; client_abort_is_an_error);

/// The same cases over verbs, run inside the Soft-RoCE VM by `scripts/verbs-test.sh`;
/// elsewhere each case says why it skips. Inside the VM they never skip.
#[cfg(feature = "verbs")]
mod ibex_verbs {
    use super::*;

    macro_rules! verbs_suite {
        ($($case:ident),* $(,)?) => {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    if std::env::var("RXE_VM").is_err() {
                        println!("skipped: no RDMA device (run scripts/verbs-test.sh)");
                        return;
                    }
                    within(cases::$case::<grpc_common::transports::IbexVerbs>()).await
                }
            )*
        };
    }

    verbs_suite!(
        unary,
        server_streaming,
        client_streaming,
        bidi_streaming,
        error_details,
        trailers_only,
        metadata,
        deadline,
        client_cancel,
        client_abort_is_an_error,
        message_sizes,
        size_limits,
        concurrent_calls,
        slow_reader,
        handler_panic,
        handler_runtime,
        graceful_shutdown,
        graceful_shutdown_idle,
        server_gone,
        interceptors,
        connect_info,
        reconnect
    );
}

/// What only the Ibex transports have: the zero-copy hook (`PeerHandle`), the mapping of
/// calls onto transport messages, and the handling of a garbage-sending peer.
mod ibex_only {
    use super::*;
    use grpc_common::transports::{ibex_config, shm_uri};
    use ibex_transport::grpc::Channel;

    /// A handler pulls a buffer the client exposed, through the `PeerHandle` in the request
    /// extensions, instead of receiving it in the body.
    async fn pull_exposed_buffer<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let ch = Channel::connect_with_config(&srv.addr, ibex_config())
            .await
            .unwrap();
        // The generated client takes the Ibex channel as it is.
        let mut c = BenchClient::new(ch.clone()).max_decoding_message_size(usize::MAX);
        let data = pattern(8 * MIB, 42);
        let exposed = ch.expose(data.clone()).await.unwrap();
        let mut req = with_mode(
            Payload {
                buffers: vec![exposed.descriptor()],
            },
            "pull",
        );
        req.metadata_mut()
            .insert("x-pull-len", (8 * MIB).to_string().parse().unwrap());
        let resp = c.echo(req).await.unwrap();
        let one_sided = resp
            .metadata()
            .get("x-one-sided")
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(
            one_sided,
            ch.one_sided().to_string(),
            "both ends agree on what the provider can do"
        );
        assert!(
            resp.into_inner().buffers == vec![data],
            "pulled data differs from the exposed buffer"
        );
        if !ch.one_sided() {
            // Once withdrawn, the descriptor is refused with a clear error, not a hang. (Over
            // shm, CMA reads the client's address space directly, so a withdrawn descriptor
            // is not refused there: reported to the shm provider, see docs/grpc.md.)
            let desc = exposed.descriptor();
            drop(exposed);
            let mut req = with_mode(
                Payload {
                    buffers: vec![desc],
                },
                "pull",
            );
            req.metadata_mut()
                .insert("x-pull-len", (8 * MIB).to_string().parse().unwrap());
            match c.echo(req).await {
                Ok(_) => panic!("a withdrawn descriptor was read"),
                Err(e) => {
                    assert_eq!(e.code(), Code::Internal, "{e:?}");
                    assert!(e.message().contains("read_remote failed"), "{e:?}");
                }
            }
        }
        srv.shutdown().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn peer_handle_shm() {
        within(pull_exposed_buffer::<IbexShm>()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn peer_handle_tcp() {
        within(pull_exposed_buffer::<IbexTcp>()).await
    }

    /// How calls map onto transport messages: a small unary call is one message each way
    /// (head, body and end coalesced), and a large body frame travels as 1 MiB pieces, each
    /// one two-part message with its packet (the packet in the announcing frame, the piece
    /// moved rendezvous, so the receiver decodes one piece while the next is moving).
    async fn message_paths<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let ch = Channel::connect_with_config(&srv.addr, ibex_config())
            .await
            .unwrap();
        // The generated Ibex client: its unary calls leave the standard head entries to
        // the packet encoder.
        let mut c = ibex_proto::bench::v1::bench_ibex::BenchClient::new(ch.clone());
        let delta = |a: &ibex_transport::ConnStats, b: &ibex_transport::ConnStats| {
            let (a, b) = (&a.proto, &b.proto);
            [
                b.eager_msgs_sent - a.eager_msgs_sent,
                b.eager_msgs_recv - a.eager_msgs_recv,
                b.rndv_msgs_sent - a.rndv_msgs_sent,
                b.rndv_msgs_recv - a.rndv_msgs_recv,
            ]
        };
        let before = ch.connection().expect("an Ibex channel").stats();
        let p = Payload {
            buffers: vec![pattern(64, 1)],
        };
        assert_eq!(c.echo(p.clone()).await.unwrap().into_inner(), p);
        let after = ch.connection().expect("an Ibex channel").stats();
        assert_eq!(
            delta(&before, &after),
            [1, 1, 0, 0],
            "64 B echo: [eager sent, eager recv, rndv sent, rndv recv]"
        );
        // By now the peer's `Hello` is in: both sides leave the standard head entries
        // (`te`, `content-type`) off the wire. Whole, this request's packet took 206
        // bytes and the answer 185.
        assert_eq!(c.echo(p.clone()).await.unwrap().into_inner(), p);
        let again = ch.connection().expect("an Ibex channel").stats();
        let sent = again.proto.eager_bytes_sent - after.proto.eager_bytes_sent;
        let recv = again.proto.eager_bytes_recv - after.proto.eager_bytes_recv;
        assert!(
            sent <= 206 - 45 && recv <= 185 - 30,
            "64 B echo with implied entries took {sent} B out and {recv} B back (156 and 151 \
             with this user agent)"
        );
        let after = again;
        // 2 MiB stays under half the flow-control window, so no window update joins in.
        let p = Payload {
            buffers: vec![pattern(2 * MIB, 2)],
        };
        assert!(c.echo(p.clone()).await.unwrap().into_inner() == p);
        let after2 = ch.connection().expect("an Ibex channel").stats();
        assert_eq!(
            delta(&after, &after2),
            [0, 0, 2, 2],
            "2 MiB echo, two pieces each way: [eager sent, eager recv, rndv sent, rndv recv]"
        );
        let body = after2.proto.rndv_bytes_sent - after.proto.rndv_bytes_sent;
        assert!(
            (2 * MIB as u64..2 * MIB as u64 + 256).contains(&body),
            "the pieces and their packets add up to the body frame: {body} B"
        );
        srv.shutdown().await.unwrap();
    }

    /// Counts the wakes of a future polled by hand, and those that come while it is being
    /// polled: a task woken while it runs is re-queued by tokio as a yield, which wakes an
    /// idle worker thread (a futex wake and a context switch) for nothing.
    /// Only wakes from the polling thread itself count: the connection's driver may wake the
    /// caller from another thread at any time, which is how it should learn of news.
    #[derive(Default)]
    struct Wakes {
        polling: std::sync::Mutex<Option<std::thread::ThreadId>>,
        during_poll: std::sync::atomic::AtomicUsize,
        notify: tokio::sync::Notify,
    }

    impl std::task::Wake for Wakes {
        fn wake(self: std::sync::Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &std::sync::Arc<Self>) {
            if *self.polling.lock().unwrap() == Some(std::thread::current().id()) {
                self.during_poll
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            self.notify.notify_one();
        }
    }

    async fn poll_by_hand<F: Future>(fut: F, wakes: &std::sync::Arc<Wakes>) -> F::Output {
        let waker = std::task::Waker::from(wakes.clone());
        let mut fut = std::pin::pin!(fut);
        loop {
            *wakes.polling.lock().unwrap() = Some(std::thread::current().id());
            let r = fut
                .as_mut()
                .poll(&mut std::task::Context::from_waker(&waker));
            *wakes.polling.lock().unwrap() = None;
            if let std::task::Poll::Ready(v) = r {
                return v;
            }
            wakes.notify.notified().await;
        }
    }

    /// 1000 calls at once on one connection with busy-polling on both ends, twenty rounds:
    /// every call finishes. The send queues fill, and the credits that make room come in
    /// on receivers reading the link themselves; those reads once made room without
    /// waking the senders waiting for it, and about one round in twenty hung for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_calls_with_busy_polling_all_finish() {
        within(async {
            let busy = ibex_transport::Config {
                spin: std::time::Duration::from_micros(500),
                ..ibex_config()
            };
            let (svc, _ev) = BenchImpl::new();
            let listener = ibex_transport::listen(&shm_uri(), busy.clone())
                .await
                .unwrap();
            let addr = listener.local_uri();
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(
                ibex_transport::grpc::Server::builder()
                    .add_service(svc.server(None, None))
                    .serve_with_listener(listener, async {
                        let _ = rx.await;
                    }),
            );
            for round in 0..20u32 {
                let ch = Channel::connect_with_config(&addr, busy.clone())
                    .await
                    .unwrap();
                let calls: Vec<_> = (0..1000u32)
                    .map(|i| {
                        let mut c = BenchClient::new(ch.clone());
                        tokio::spawn(async move {
                            let p = Payload {
                                buffers: vec![Bytes::from(i.to_le_bytes().to_vec())],
                            };
                            let r = c.echo(p.clone()).await.unwrap().into_inner();
                            assert_eq!(r, p, "round {round}: call {i} got another's reply");
                        })
                    })
                    .collect();
                for call in calls {
                    call.await.unwrap();
                }
            }
            let _ = tx.send(());
            server.await.unwrap().unwrap();
        })
        .await;
    }

    /// A caller reads the connection for its own call (whoever waits, reads); what it reads
    /// for itself must not wake it while it runs. Unary calls (the response head) and a
    /// bidirectional stream (each answer a frame of the response body) over shm. With no
    /// spin budget: a spinning caller wakes itself on purpose, once per spin step.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caller_reading_for_itself_does_not_wake_itself() {
        within(async {
            let (srv, _ev) = start::<IbexShm>(None, None).await;
            let config = ibex_transport::Config {
                spin: std::time::Duration::ZERO,
                ..ibex_config()
            };
            let ch = Channel::connect_with_config(&srv.addr, config)
                .await
                .unwrap();
            let mut c = BenchClient::new(ch);
            for i in 0..50u8 {
                let wakes = std::sync::Arc::new(Wakes::default());
                let p = Payload {
                    buffers: vec![pattern(64, i)],
                };
                let r = poll_by_hand(c.echo(p.clone()), &wakes).await.unwrap();
                assert_eq!(r.into_inner(), p);
                assert_eq!(
                    wakes.during_poll.load(std::sync::atomic::Ordering::SeqCst),
                    0,
                    "call {i} woke its caller while the caller was running"
                );
            }
            // A chat answers each message as it comes, so every answer is read by the
            // task waiting for it.
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let mut answers = c
                .chat(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            for i in 0..20u8 {
                let p = Payload {
                    buffers: vec![pattern(100, i)],
                };
                tx.send(p.clone()).await.unwrap();
                let wakes = std::sync::Arc::new(Wakes::default());
                let m = poll_by_hand(answers.message(), &wakes).await.unwrap();
                assert_eq!(m, Some(p));
                assert_eq!(
                    wakes.during_poll.load(std::sync::atomic::Ordering::SeqCst),
                    0,
                    "answer {i} woke its reader while the reader was running"
                );
            }
            drop(tx);
            srv.shutdown().await.unwrap();
        })
        .await;
    }

    /// One channel type and one server call for both worlds: `connect_any`/`serve_any` speak
    /// stock HTTP/2 for `http://` and Ibex for Ibex addresses, with the same generated
    /// client; the Ibex-only hooks say clearly that HTTP/2 has none.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connect_any_and_serve_any_speak_http2_and_ibex() {
        within(async {
            // `https://` without a client TLS setting says what to set.
            let e = Channel::connect_any("https://127.0.0.1:1", ibex_config())
                .await
                .unwrap_err();
            assert!(e.to_string().contains("Config::tls"), "{e}");
            let port = ibex_test_support::free_port();
            for uri in [format!("http://127.0.0.1:{port}"), shm_uri()] {
                let (svc, _ev) = BenchImpl::new();
                let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                let server = tokio::spawn({
                    let uri = uri.clone();
                    async move {
                        ibex_transport::grpc::Server::builder()
                            .add_service(svc.server(None, None))
                            .serve_any(&uri, async {
                                let _ = rx.await;
                            })
                            .await
                    }
                });
                let ch = loop {
                    match Channel::connect_any(&uri, ibex_config()).await {
                        Ok(ch) => break ch,
                        Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                };
                let mut c = BenchClient::new(ch.clone());
                let bufs = vec![pattern(5000, 7)];
                let r = c
                    .echo(Payload {
                        buffers: bufs.clone(),
                    })
                    .await
                    .unwrap()
                    .into_inner();
                assert_eq!(r.buffers, bufs, "{uri}");
                let e = c
                    .echo(with_mode(Payload { buffers: vec![] }, "fail"))
                    .await
                    .unwrap_err();
                assert_test_error(&e);
                if uri.starts_with("http://") {
                    assert!(ch.connection().is_none() && !ch.one_sided());
                    let e = ch.expose(Bytes::from_static(b"x")).await.unwrap_err();
                    assert!(e.to_string().contains("HTTP/2"), "{e}");
                } else {
                    assert!(ch.connection().is_some());
                }
                drop(c);
                drop(ch);
                tx.send(()).unwrap();
                server.await.unwrap().unwrap();
            }
        })
        .await
    }

    /// Interceptors as production services use them, unchanged from stock tonic: an
    /// intercepted server goes into `add_service`, and the generated client's
    /// `with_interceptor` takes an Ibex channel. The server's interceptor rejects calls
    /// without the token and lets the others through. An interceptor runs when the
    /// connection's task calls the service, so one that panics must fail only its own call
    /// (as a panicking handler does), never the connection.
    async fn interceptors(uri: String) {
        use ibex_proto::bench::v1::bench_server::BenchServer;
        fn check_auth(req: Request<()>) -> Result<Request<()>, Status> {
            if req.metadata().contains_key("x-panic") {
                panic!("interceptor panics on purpose (test)");
            }
            match req.metadata().get("authorization") {
                Some(t) if t == "Bearer secret" => Ok(req),
                _ => Err(Status::unauthenticated("no valid token")),
            }
        }
        let (svc, _ev) = BenchImpl::new();
        let listener = ibex_transport::listen(&uri, ibex_config()).await.unwrap();
        let addr = listener.local_uri();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(
            ibex_transport::grpc::Server::builder()
                .add_service(BenchServer::with_interceptor(svc, check_auth))
                .serve_with_listener(listener, async {
                    let _ = rx.await;
                }),
        );
        let ch = Channel::connect_with_config(&addr, ibex_config())
            .await
            .unwrap();
        // What the generic `interceptors` case checks over every transport, here with
        // Ibex's own `Builder::add_service` and `Channel`: both accept tonic's intercepted
        // types unchanged.
        let mut plain = BenchClient::new(ch.clone());
        let e = plain.echo(Payload::default()).await.unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
        let mut authed = BenchClient::with_interceptor(ch.clone(), |mut req: Request<()>| {
            req.metadata_mut()
                .insert("authorization", "Bearer secret".parse().unwrap());
            Ok(req)
        });
        assert!(authed.echo(Payload::default()).await.is_ok());
        let mut bad = Request::new(Payload::default());
        bad.metadata_mut().insert("x-panic", "1".parse().unwrap());
        let e = plain.echo(bad).await.unwrap_err();
        assert_eq!(e.code(), Code::Cancelled, "{e:?}");
        // The same connection goes on.
        assert!(authed.echo(Payload::default()).await.is_ok());
        assert!(!ch.connection().unwrap().is_closed());
        drop((plain, authed, ch));
        tx.send(()).unwrap();
        server.await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn interceptors_shm() {
        within(interceptors(shm_uri())).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn interceptors_tcp() {
        within(interceptors("tcp://127.0.0.1:0".into())).await
    }

    /// The server restarts on the same address: the channel reconnects on a later call (as
    /// tonic's does), and a lazy channel made before any server exists connects once one is
    /// up. Every call either fails `Unavailable` or succeeds; none hangs.
    async fn reconnect(uri: String) {
        async fn serve(
            uri: &str,
        ) -> (
            tokio::sync::oneshot::Sender<()>,
            tokio::task::JoinHandle<ibex_transport::Result<()>>,
        ) {
            let (svc, _ev) = BenchImpl::new();
            let listener = ibex_transport::listen(uri, ibex_config()).await.unwrap();
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let h = tokio::spawn(
                ibex_transport::grpc::Server::builder()
                    .add_service(svc.server(None, None))
                    .serve_with_listener(listener, async {
                        let _ = rx.await;
                    }),
            );
            (tx, h)
        }
        /// Calls until one succeeds; earlier failures must be `Unavailable`.
        async fn until_ok(c: &mut BenchClient<Channel>) -> usize {
            for attempt in 0..200 {
                match c
                    .echo(Payload {
                        buffers: vec![pattern(10, 1)],
                    })
                    .await
                {
                    Ok(r) => {
                        assert_eq!(r.into_inner().buffers, vec![pattern(10, 1)]);
                        return attempt;
                    }
                    Err(e) => {
                        // Stock tonic reports the server's alert as `Unknown("transport error")`.
                        assert!(
                            matches!(e.code(), Code::Unavailable | Code::Unknown),
                            "{e:?}"
                        );
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
            panic!("no call succeeded after the server came back");
        }
        let lazy = Channel::connect_lazy(&uri, ibex_config()).unwrap();
        let mut lc = BenchClient::new(lazy);
        let e = lc.echo(Payload::default()).await.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "no server yet: {e:?}");
        let (stop, h) = serve(&uri).await;
        until_ok(&mut lc).await;
        let ch = Channel::connect_with_config(&uri, ibex_config())
            .await
            .unwrap();
        let mut c = BenchClient::new(ch);
        until_ok(&mut c).await;
        // Restart: stop the server (graceful), start another on the same address.
        stop.send(()).unwrap();
        h.await.unwrap().unwrap();
        let (stop, h) = serve(&uri).await;
        until_ok(&mut c).await;
        until_ok(&mut lc).await;
        drop((c, lc));
        stop.send(()).unwrap();
        h.await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reconnect_shm() {
        within(reconnect(shm_uri())).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reconnect_tcp() {
        let port = ibex_test_support::free_port();
        within(reconnect(format!("tcp://127.0.0.1:{port}"))).await
    }

    /// What a handler learns about its caller, as over stock tonic: `remote_addr()` (tcp),
    /// the peer's pid (shm), the provider, a `user-agent` naming tonic, Ibex and the
    /// transport; and a `date` on every response.
    async fn connect_info(uri: String) {
        let (srv, _ev) = start_at(uri).await;
        let ch = Channel::connect_with_config(&srv.addr, ibex_config())
            .await
            .unwrap();
        let mut c = BenchClient::new(ch.clone());
        let r = c
            .echo(with_mode(Payload::default(), "whoami"))
            .await
            .unwrap();
        let md = r.metadata();
        let get = |k: &str| md.get(k).map(|v| v.to_str().unwrap().to_string());
        let provider = get("x-provider").expect("ConnectInfo in the extensions");
        let ua = get("x-user-agent").expect("a user-agent");
        assert!(
            ua.starts_with("tonic/") && ua.contains("ibex/") && ua.contains(&provider),
            "{ua}"
        );
        assert!(
            get("date").is_some_and(|d| d.ends_with(" GMT")),
            "{:?}",
            get("date")
        );
        match provider.as_str() {
            "tcp" => {
                let a = get("x-remote-addr").expect("remote_addr() over tcp");
                assert!(a.starts_with("127.0.0.1:"), "{a}");
            }
            "shm" => {
                assert_eq!(get("x-peer-pid"), Some(std::process::id().to_string()));
                // SAFETY: getuid has no preconditions and cannot fail.
                let uid = unsafe { libc::getuid() };
                assert_eq!(get("x-peer-uid"), Some(uid.to_string()));
            }
            other => panic!("provider {other}"),
        }
        drop((c, ch));
        srv.shutdown().await.unwrap();
    }

    async fn start_at(uri: String) -> (ServerHandle, Events) {
        let (svc, ev) = BenchImpl::new();
        let services = Services::new(svc.server(None, None));
        (grpc_common::transports::ibex_serve(uri, services).await, ev)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connect_info_shm() {
        within(connect_info(shm_uri())).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connect_info_tcp() {
        within(connect_info("tcp://127.0.0.1:0".into())).await
    }

    /// `Endpoint` settings as tonic users set them: a default timeout the server also
    /// enforces, a concurrency limit that queues calls, a connect timeout against a peer
    /// that never answers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn endpoint_settings() {
        use ibex_transport::grpc::Endpoint;
        within(async {
            let (srv, mut ev) = start_at(shm_uri()).await;
            // Two seconds, not less: the held call's handler must start, and the second
            // call make its whole round trip, inside it on a loaded debug build.
            let ch = Endpoint::new(srv.addr.clone())
                .unwrap()
                .config(ibex_config())
                .timeout(Duration::from_secs(2))
                .concurrency_limit(1)
                .connect()
                .await
                .unwrap();
            let mut c = BenchClient::new(ch.clone());
            // The default deadline applies to a call that sets none, on both sides.
            let t0 = std::time::Instant::now();
            let mut held = c.clone();
            let first =
                tokio::spawn(async move { held.echo(with_mode(Payload::default(), "hold")).await });
            assert_eq!(next_event(&mut ev).await, Event::Started("echo"));
            // One slot: this call waits for the held one to time out, then runs.
            let r = c
                .echo(Payload {
                    buffers: vec![pattern(3, 3)],
                })
                .await
                .unwrap();
            assert_eq!(r.into_inner().buffers, vec![pattern(3, 3)]);
            let e = first.await.unwrap().unwrap_err();
            assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
            let waited = t0.elapsed();
            assert!(
                waited >= Duration::from_millis(1950),
                "the second call did not wait for the slot: {waited:?}"
            );
            // The held call's handler is cancelled by its deadline; the second call's start
            // may be seen before or after that (the client's slot frees at its own deadline).
            let events = [next_event(&mut ev).await, next_event(&mut ev).await];
            assert!(
                events.contains(&Event::Cancelled("echo"))
                    && events.contains(&Event::Started("echo")),
                "{events:?}"
            );
            drop((c, ch));
            srv.shutdown().await.unwrap();

            // Keep-alive on a tcp channel (TCP's and Ibex's pings, with tonic's window
            // settings accepted): calls go through as usual, also after idling through
            // several ping intervals on the same connection.
            let (srv, _ev) = start_at("tcp://127.0.0.1:0".into()).await;
            let ch = Endpoint::new(srv.addr.clone())
                .unwrap()
                .config(ibex_config())
                .tcp_keepalive(Some(Duration::from_secs(30)))
                .http2_keep_alive_interval(Duration::from_millis(100))
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(true)
                .initial_connection_window_size(64 << 20)
                .initial_stream_window_size(8 << 20)
                .buffer_size(1024)
                .tcp_nodelay(true)
                .connect()
                .await
                .unwrap();
            let mut c = BenchClient::new(ch.clone());
            assert!(c.echo(Payload::default()).await.is_ok());
            let conn = ch.connection().expect("an Ibex connection");
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert!(c.echo(Payload::default()).await.is_ok());
            assert!(
                !conn.is_closed(),
                "pings kept the idle connection, not replaced it"
            );
            drop(c);
            srv.shutdown().await.unwrap();

            // A tcp peer that accepts and never speaks: connect gives up at the timeout.
            let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = format!("tcp://{}", silent.local_addr().unwrap());
            let t0 = std::time::Instant::now();
            let e = Endpoint::new(addr)
                .unwrap()
                .config(ibex_config())
                .connect_timeout(Duration::from_millis(200))
                .connect()
                .await
                .unwrap_err();
            assert!(e.to_string().contains("connect_timeout"), "{e}");
            assert!(t0.elapsed() < Duration::from_secs(3));
            drop(silent);
        })
        .await
    }

    /// A server's per-connection limits answer the peer that breaks them and nobody else:
    /// a call past `max_concurrent_calls` is refused at once naming the setting, and a
    /// header list past `max_header_list_size` ends that client's connection (clear error)
    /// while another client goes on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn per_connection_limits_cost_only_the_offender() {
        within(async {
            let (svc, mut ev) = BenchImpl::new();
            let listener = ibex_transport::listen(&shm_uri(), ibex_config())
                .await
                .unwrap();
            let addr = listener.local_uri();
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(
                ibex_transport::grpc::Server::builder()
                    .max_concurrent_calls(1)
                    .max_header_list_size(1024)
                    .add_service(svc.server(None, None))
                    .serve_with_listener(listener, async {
                        let _ = rx.await;
                    }),
            );
            let ch = Channel::connect_with_config(&addr, ibex_config())
                .await
                .unwrap();
            let mut c = BenchClient::new(ch.clone());
            // One call parks in the handler; the second is over the limit.
            let mut parked = c.clone();
            let first = tokio::spawn(async move {
                parked
                    .echo(with_mode(Payload { buffers: vec![] }, "hold"))
                    .await
            });
            loop {
                if let Event::Started(_) = next_event(&mut ev).await {
                    break;
                }
            }
            let e = c.echo(Payload { buffers: vec![] }).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
            assert!(e.message().contains("max_concurrent_calls"), "{e:?}");
            first.abort();
            let _ = first.await;

            // A header list over 1 KiB: that client's connection ends.
            let bad = Channel::connect_with_config(&addr, ibex_config())
                .await
                .unwrap();
            let mut bc = BenchClient::new(bad);
            let mut req = Request::new(Payload { buffers: vec![] });
            req.metadata_mut()
                .insert("x-big", "v".repeat(2000).parse().unwrap());
            let e = bc.echo(req).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
            // The first client still works (its parked call was cancelled above).
            let mut ok = false;
            // On the clock, not a count of tries: a loaded machine may take a while.
            let until = std::time::Instant::now() + Duration::from_secs(30);
            while std::time::Instant::now() < until {
                match c.echo(Payload { buffers: vec![] }).await {
                    Ok(_) => {
                        ok = true;
                        break;
                    }
                    // The cancelled call may still be leaving the server.
                    Err(e) if e.code() == tonic::Code::ResourceExhausted => {
                        tokio::time::sleep(Duration::from_millis(10)).await
                    }
                    Err(e) => panic!("{e:?}"),
                }
            }
            assert!(ok, "the honest client was not answered");
            drop(c);
            drop(ch);
            tx.send(()).unwrap();
            server.await.unwrap().unwrap();
        })
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn message_paths_shm() {
        within(message_paths::<IbexShm>()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn message_paths_tcp() {
        within(message_paths::<IbexTcp>()).await
    }

    /// Serves `builder` on `listener` until the returned sender is sent to.
    fn serve_until_told(
        builder: ibex_transport::grpc::Builder,
        listener: ibex_transport::Listener,
    ) -> (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<ibex_transport::Result<()>>,
    ) {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(builder.serve_with_listener(listener, async {
            let _ = rx.await;
        }));
        (tx, server)
    }

    /// A body piece the transport refuses (over the peer's `max_message_size`, here below the
    /// 1 MiB piece size) fails only its call, with `ResourceExhausted` naming the limit, in
    /// either direction; the connection's framing survives and the next call works.
    async fn transport_limit(uri: impl Fn() -> String) {
        let small = ibex_transport::Config {
            max_message_size: MIB as u64 / 4,
            ..ibex_config()
        };
        for (server_cfg, client_cfg) in [
            (small.clone(), ibex_config()),
            (ibex_config(), small.clone()),
        ] {
            let (svc, _ev) = BenchImpl::new();
            let listener = ibex_transport::listen(&uri(), server_cfg).await.unwrap();
            let addr = listener.local_uri();
            let (tx, server) = serve_until_told(
                ibex_transport::grpc::Server::builder()
                    .add_service(svc.server(Some(usize::MAX), None)),
                listener,
            );
            let ch = Channel::connect_with_config(&addr, client_cfg)
                .await
                .unwrap();
            let mut c = BenchClient::new(ch).max_decoding_message_size(usize::MAX);
            let e = match c
                .echo(Payload {
                    buffers: vec![pattern(2 * MIB, 1)],
                })
                .await
            {
                Ok(_) => panic!("a 2 MiB message passed a 256 KiB transport limit"),
                Err(e) => e,
            };
            assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
            assert!(e.message().contains("max_message_size"), "{e:?}");
            let p = Payload {
                buffers: vec![pattern(100, 2)],
            };
            assert_eq!(c.echo(p.clone()).await.unwrap().into_inner(), p);
            let _ = tx.send(());
            server.await.unwrap().unwrap();
        }
    }

    /// A packet too long to ride in the frame that announces its body (a head of several
    /// KiB against a peer's 4 KiB slots) takes the body inline instead: one message all
    /// the same, and the call works.
    async fn long_heads_take_their_body_inline(uri: impl Fn() -> String) {
        let small_slots = ibex_transport::Config {
            slot_size: 4096,
            eager_threshold: Some(2048),
            ..ibex_config()
        };
        let (svc, _ev) = BenchImpl::new();
        let listener = ibex_transport::listen(&uri(), small_slots).await.unwrap();
        let addr = listener.local_uri();
        let (tx, server) = serve_until_told(
            ibex_transport::grpc::Server::builder().add_service(svc.server(None, None)),
            listener,
        );
        let ch = Channel::connect_with_config(&addr, ibex_config())
            .await
            .unwrap();
        let room = ch.connection().expect("an Ibex channel").head_room();
        assert!(room < 4096, "{room}");
        let mut c = BenchClient::new(ch);
        for long in [false, true] {
            let p = Payload {
                buffers: vec![pattern(64 << 10, 3)],
            };
            let mut req = Request::new(p.clone());
            if long {
                req.metadata_mut()
                    .insert("x-long", "v".repeat(room + 100).parse().unwrap());
            }
            assert!(c.echo(req).await.unwrap().into_inner() == p);
        }
        let _ = tx.send(());
        server.await.unwrap().unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn long_heads_take_their_body_inline_shm() {
        within(long_heads_take_their_body_inline(
            grpc_common::transports::shm_uri,
        ))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn long_heads_take_their_body_inline_tcp() {
        within(long_heads_take_their_body_inline(|| {
            "tcp://127.0.0.1:0".to_string()
        }))
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn transport_limit_shm() {
        within(transport_limit(grpc_common::transports::shm_uri)).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn transport_limit_tcp() {
        within(transport_limit(|| "tcp://127.0.0.1:0".to_string())).await
    }

    /// A client that sends garbage loses its own connection, with no panic, and the server
    /// goes on serving everyone else.
    async fn garbage_closes_only_that_connection<T: Transport>() {
        let (srv, _ev) = start::<T>(None, None).await;
        let raw = ibex_transport::connect(&srv.addr, ibex_config())
            .await
            .unwrap();
        raw.send(Bytes::from_static(b"\x00\x00\x00\x01\x01\xff\xff\xff\xff"))
            .await
            .unwrap();
        assert!(
            raw.recv().await.is_err(),
            "the server answered garbage instead of closing"
        );
        // A well-formed request head announcing 40000 headers (allocated unchecked, that
        // count panics inside `http`'s HeaderMap): the connection closes.
        let raw = ibex_transport::connect(&srv.addr, ibex_config())
            .await
            .unwrap();
        let mut head = BytesMut::new();
        head.put_u16(5);
        head.put_slice(b"/a/b/");
        head.put_u16(40000);
        for _ in 0..40000 {
            head.put_u16(1);
            head.put_u8(b'h');
            head.put_u32(0);
        }
        let mut pkt = BytesMut::new();
        pkt.put_u32(1);
        pkt.put_u8(1); // HEAD
        pkt.put_u32(head.len() as u32);
        pkt.put_slice(&head);
        raw.send(pkt.freeze()).await.unwrap();
        assert!(
            raw.recv().await.is_err(),
            "the server answered an oversized header list instead of closing"
        );
        let mut c = client::<T>(&srv).await;
        let p = Payload {
            buffers: vec![pattern(10, 1)],
        };
        assert_eq!(c.echo(p.clone()).await.unwrap().into_inner(), p);
        srv.shutdown().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn garbage_shm() {
        within(garbage_closes_only_that_connection::<IbexShm>()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn garbage_tcp() {
        within(garbage_closes_only_that_connection::<IbexTcp>()).await
    }

    /// Over HTTP/2 nothing crosses the wire in extensions: the handler finds no handle.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stock_tonic_has_no_peer_handle() {
        within(async {
            let (srv, _ev) = start::<Stock>(None, None).await;
            let mut c = client::<Stock>(&srv).await;
            let mut req = with_mode(
                Payload {
                    buffers: vec![Bytes::from_static(b"desc")],
                },
                "pull",
            );
            req.metadata_mut()
                .insert("x-pull-len", "4".parse().unwrap());
            let e = c.echo(req).await.unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
            srv.shutdown().await.unwrap();
        })
        .await
    }
}
