//! The outgoing half of a call (the request on the client, the response on the server):
//! turns an `http_body::Body` into packets. Whatever the body has ready at once rides in the
//! same packet as the head, so a unary call is one message each way; after that each body
//! frame waits for flow-control window and goes as its own packet.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame};
use tokio::time::Instant;
use tonic::Status;

use super::body::ReadSource;
use super::wire::Packet;
use super::{CallShared, Mux, read_while, transport_status};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Which end is sending: it decides how the call ends.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// Request bodies end with `END` (half-close); a failing body resets the call.
    Client,
    /// Response bodies end with trailers; failures and deadlines become a status there.
    Server,
}

/// How pumping ended.
pub(crate) enum Pumped {
    /// The body went out to its end.
    Done,
    /// The call was over first (cancelled, reset, finished by the peer, connection gone).
    Stopped,
    /// The body failed, or the transport refused a message: the call was reset (client) or
    /// ended with this status (server) where the connection still allowed it.
    Failed(Status),
}

/// Marks the head as out when pumping moves past it (or gives up), whichever way it ends.
struct HeadOut<'a>(&'a CallShared);

impl Drop for HeadOut<'_> {
    fn drop(&mut self) {
        self.0.head_sent.set();
    }
}

type Polled<B> = Option<Result<Frame<<B as Body>::Data>, <B as Body>::Error>>;

/// The next frame if the body has one ready now; `None` if it would wait.
fn ready_now<B: Body + ?Sized>(body: &mut Pin<Box<B>>) -> Option<Polled<B>> {
    let mut cx = Context::from_waker(Waker::noop());
    match body.as_mut().poll_frame(&mut cx) {
        Poll::Ready(x) => Some(x),
        Poll::Pending => None,
    }
}

pub(crate) fn status_trailers(status: &Status) -> HeaderMap {
    let mut h = HeaderMap::new();
    if let Err(e) = status.add_header(&mut h) {
        // Only the details or metadata can fail to encode; the code itself always does.
        h.clear();
        let _ = Status::internal(format!(
            "could not encode the call's status: {}",
            e.message()
        ))
        .add_header(&mut h);
    }
    h
}

fn sent(r: crate::error::Result<()>) -> Pumped {
    match r {
        Ok(()) => Pumped::Done,
        Err(e) => Pumped::Failed(transport_status(&e)),
    }
}

/// Sends `head` and then `body` for call `id`. `deadline` (server only) ends the response
/// with `DeadlineExceeded` if the body is still going when it passes. `reader` (client
/// only) is read while waiting for window, since the peer's grants arrive on it.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn pump<B>(
    mux: &Arc<Mux>,
    id: u32,
    call: &CallShared,
    head: Packet,
    body: B,
    side: Side,
    deadline: Option<Instant>,
    reader: Option<&dyn ReadSource>,
) -> Pumped
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut body = Box::pin(body);
    let _head_out = HeadOut(call);
    if call.done.is_set() {
        // Cancelled before anything went out: the peer never hears of this call.
        call.head_skipped
            .store(true, std::sync::atomic::Ordering::Release);
        return Pumped::Stopped;
    }
    // The packet being filled, and its body frame.
    let mut pending: Option<(Packet, Option<Bytes>)> = Some((head, None));
    loop {
        let item = match pending {
            Some(_) => match ready_now(&mut body)
                .map(|item| item.map(|r| r.map_err(Into::<BoxError>::into)))
            {
                Some(item) => item,
                None => {
                    if let Some((p, d)) = pending.take()
                        && let Err(e) = mux.send(p, d).await
                    {
                        return Pumped::Failed(transport_status(&e));
                    }
                    continue;
                }
            },
            None => {
                let next = std::future::poll_fn(|cx| {
                    body.as_mut()
                        .poll_frame(cx)
                        .map(|item| item.map(|r| r.map_err(Into::<BoxError>::into)))
                });
                let sleep = async {
                    match deadline {
                        Some(d) => tokio::time::sleep_until(d).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    _ = call.done.wait() => return Pumped::Stopped,
                    item = next => item,
                    _ = sleep => {
                        let mut p = Packet::new(id);
                        p.trailers = Some(status_trailers(&Status::deadline_exceeded("Deadline expired before the response completed")));
                        let _ = mux.send(p, None).await;
                        return Pumped::Stopped;
                    }
                }
            }
        };
        let (mut p, d) = pending.take().unwrap_or_else(|| (Packet::new(id), None));
        match item {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut data) => {
                    // One body frame per packet: send what is filled, start a new one.
                    let mut p = p;
                    if d.is_some() {
                        if let Err(e) = mux.send(p, d).await {
                            return Pumped::Failed(transport_status(&e));
                        }
                        p = Packet::new(id);
                    }
                    // A large frame goes in pieces (views of it, no copy), so the receiver
                    // can hand the first to its decoder while the next is still moving: a
                    // whole 16 MiB message would otherwise be read, then copied by tonic's
                    // decoder, then answered, one stage after the other. The last piece
                    // takes the remainder (up to two pieces' worth), so a message just over
                    // a multiple of the piece size does not end in a tiny one.
                    let piece_size = mux.sizes().1;
                    while data.len() >= 2 * piece_size {
                        let piece = data.split_to(piece_size);
                        if !acquire(call, piece.len(), reader).await {
                            return Pumped::Stopped;
                        }
                        if let Err(e) = mux.send(p, Some(piece)).await {
                            return Pumped::Failed(transport_status(&e));
                        }
                        p = Packet::new(id);
                    }
                    if !acquire(call, data.len(), reader).await {
                        return Pumped::Stopped;
                    }
                    pending = Some((p, Some(data)));
                }
                Err(frame) => {
                    // Trailers end the call; gRPC requests carry none, so a client just ends.
                    match (side, frame.into_trailers()) {
                        (Side::Server, Ok(t)) => p.trailers = Some(t),
                        _ => p.end = true,
                    }
                    return sent(mux.send(p, d).await);
                }
            },
            None => {
                p.end = true;
                return sent(mux.send(p, d).await);
            }
            Some(Err(e)) => {
                let status = Status::from_error(e);
                match side {
                    Side::Server => p.trailers = Some(status_trailers(&status)),
                    Side::Client => p.reset = true,
                }
                let _ = mux.send(p, d).await;
                return Pumped::Failed(status);
            }
        }
    }
}

/// Takes window for `len` bytes, reading the connection meanwhile where no task does.
async fn acquire(call: &CallShared, len: usize, reader: Option<&dyn ReadSource>) -> bool {
    match reader {
        Some(r) => read_while(r, call.acquire(len)).await,
        None => call.acquire(len).await,
    }
}
