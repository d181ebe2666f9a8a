//! The outgoing half of a call (request on the client, response on the server): turns an
//! `http_body::Body` into packets. What the body has ready at once rides with the head, so a
//! unary call is one message each way; later frames each wait for window and go alone.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame};
use tokio::time::Instant;
use tonic::Status;

use super::body::ReadSource;
use super::wire::{Head, Packet, Trailers};
use super::{CallShared, Encoded, Mux, read_while, transport_status};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
fn ready_now<B: Body + Unpin>(body: &mut B) -> Option<Polled<B>> {
    let mut cx = Context::from_waker(Waker::noop());
    match Pin::new(body).poll_frame(&mut cx) {
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

/// A response that is only a status: its head, ended, as gRPC's trailers-only answer.
pub(crate) fn trailers_only(id: u32, status: Status) -> Packet {
    let (parts, ()) = status.into_http::<()>().into_parts();
    let mut p = Packet::new(id);
    p.head = Some(Head::Response {
        status: parts.status,
        headers: parts.headers,
        standard: None,
    });
    p.end = true;
    p
}

fn sent(r: crate::error::Result<()>) -> Pumped {
    match r {
        Ok(()) => Pumped::Done,
        Err(e) => Pumped::Failed(transport_status(&e)),
    }
}

/// Sends `first` (the head packet and any body frame taken for it), then `body`, for call `id`.
/// `deadline` (server) ends the response with `DeadlineExceeded` if it passes mid-body;
/// `reader` (client) is read while waiting for window, since the grants arrive on it.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn pump<B>(
    mux: &Arc<Mux>,
    id: u32,
    call: &CallShared,
    first: (Packet, Option<Bytes>),
    body: B,
    side: Side,
    deadline: Option<Instant>,
    reader: Option<&dyn ReadSource>,
) -> Pumped
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    let mut body = body;
    let _head_out = HeadOut(call);
    if call.done.is_set() {
        // Cancelled before anything went out: the peer never hears of this call.
        call.head_skipped
            .store(true, std::sync::atomic::Ordering::Release);
        return Pumped::Stopped;
    }
    // The packet being filled, and its body frame.
    let mut pending: Option<(Packet, Option<Bytes>)> = Some(first);
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
                    Pin::new(&mut body)
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
                        p.trailers = Some(Trailers::map(status_trailers(&Status::deadline_exceeded("Deadline expired before the response completed"))));
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
                    // A large frame goes in pieces (views, no copy) so the receiver decodes
                    // the first while the next still moves, instead of read, copy and answer
                    // in turn. The last piece takes the remainder (under two pieces' worth),
                    // so no message ends in a tiny piece.
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
                        (Side::Server, Ok(t)) => p.trailers = Some(Trailers::map(t)),
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
                    Side::Server => p.trailers = Some(Trailers::map(status_trailers(&status))),
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

/// What [`pump_now`] did with the outgoing half of a call.
pub(crate) enum Now<B> {
    /// All of it is queued on the connection.
    Sent,
    /// All of it is one encoded packet, which waits for room in the send queue.
    Unsent(Encoded),
    /// The rest would wait, is large, or failed: [`pump`] goes on from it. Boxed, so the unary
    /// calls that never get here do not copy a large `Now` around.
    Rest(Box<Remainder<B>>),
    /// The transport refused the packet (the connection is failing).
    Failed(Status),
}

/// What is left of a call's outgoing half for [`pump`]: `first` is the packet to send
/// first, and `body` the rest, with the item already taken put back in front.
pub(crate) struct Remainder<B> {
    pub(crate) first: (Packet, Option<Bytes>),
    pub(crate) body: Prepend<B>,
}

impl<B> Now<B> {
    fn rest(head: Packet, data: Option<Bytes>, body: Prepend<B>) -> Now<B> {
        Now::Rest(Box::new(Remainder {
            first: (head, data),
            body,
        }))
    }
}

/// Sends `head` and the body when all of it is ready at once and fits in one packet (a unary
/// call, usually), with no future and no wait, saving a large future allocated per call;
/// otherwise returns what [`pump`] is to do with the rest.
pub(crate) fn pump_now<B>(mux: &Mux, mut head: Packet, mut body: B, side: Side) -> Now<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let inline_max = mux.inline_max();
    let mut data = None;
    loop {
        let Some(item) = ready_now(&mut body) else {
            return Now::rest(head, data, Prepend::new(None, body));
        };
        match item {
            Some(Ok(frame)) => match frame.into_data() {
                // One small body frame rides with the head.
                Ok(d) if data.is_none() && d.len() <= inline_max => data = Some(d),
                Ok(d) => {
                    return Now::rest(head, data, Prepend::new(Some(Ok(Frame::data(d))), body));
                }
                Err(frame) => {
                    match (side, frame.into_trailers()) {
                        (Side::Server, Ok(t)) => head.trailers = Some(Trailers::map(t)),
                        _ => head.end = true,
                    }
                    break;
                }
            },
            None => {
                head.end = true;
                break;
            }
            // A failing body ends the call the way `pump` ends it.
            Some(Err(e)) => {
                return Now::rest(head, data, Prepend::new(Some(Err(e.into())), body));
            }
        }
    }
    match mux.send_now(head, data) {
        Ok(None) => Now::Sent,
        Ok(Some(unsent)) => Now::Unsent(unsent),
        Err(e) => Now::Failed(transport_status(&e)),
    }
}

/// A body whose first frame was already taken from it (by the server's first try at
/// answering a call in place), put back in front.
pub(crate) struct Prepend<B> {
    first: Option<Result<Frame<Bytes>, BoxError>>,
    rest: B,
}

impl<B> Prepend<B> {
    pub(crate) fn new(first: Option<Result<Frame<Bytes>, BoxError>>, rest: B) -> Self {
        Prepend { first, rest }
    }
}

impl<B> Body for Prepend<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(f) = self.first.take() {
            return Poll::Ready(Some(f));
        }
        Pin::new(&mut self.rest)
            .poll_frame(cx)
            .map(|f| f.map(|r| r.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.rest.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_taken_item_comes_back_first() {
        let rest = http_body_util::Full::new(Bytes::from_static(b"rest"));
        let body = Prepend::new(Some(Ok(Frame::data(Bytes::from_static(b"first")))), rest);
        let all = body.collect().await.map(|c| c.to_bytes());
        assert_eq!(all.ok().as_deref(), Some(&b"firstrest"[..]));

        let rest = http_body_util::Full::new(Bytes::from_static(b"rest"));
        let mut body = Prepend::new(Some(Err("the body failed".into())), rest);
        let first = body.frame().await;
        assert!(matches!(first, Some(Err(e)) if e.to_string() == "the body failed"));
        let next = body
            .frame()
            .await
            .and_then(|f| f.ok())
            .and_then(|f| f.into_data().ok());
        assert_eq!(next.as_deref(), Some(&b"rest"[..]));
    }
}
