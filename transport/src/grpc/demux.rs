//! The inbound half of the call framing, sans IO: turns a connection's transport messages
//! back into packets with their body frames, fed by whichever task reads the connection. A
//! packet and its body are one message (inline, or a two-part message's second part).

use bytes::Bytes;

use super::wire::{Data, Head, Limits, Packet, Seen, Trailers, WholeParts};
use crate::error::{Error, Result};

/// A whole head kept for repeats: its bytes, and what they decoded to (an answer's with its
/// `grpc-status: 0` merged in, see `Trailers::OkInHead`).
#[derive(Debug)]
struct Kept {
    bytes: Vec<u8>,
    head: Head,
}

/// Reassembles packets from one connection's messages, in order.
#[derive(Debug)]
pub(crate) struct Demux {
    /// True on the server: packets carry request heads.
    request: bool,
    limits: Limits,
    seen: Seen,
    /// Heads of whole unary packets that came twice among the last few (at most
    /// [`Demux::MAX_KEPT`]; a new one takes the slots in turn).
    kept: Vec<Kept>,
    /// The head blocks of the last whole unary packets whose head is not kept, most
    /// recent last (at most [`Demux::MAX_KEPT`]).
    recent: Vec<Vec<u8>>,
    /// Packets whose head was a repeat, not decoded again.
    repeats: u64,
    /// The slot the next kept head takes once all are in use.
    next_slot: usize,
}

impl Demux {
    pub(crate) fn new(request: bool, limits: Limits) -> Demux {
        Demux {
            request,
            limits,
            seen: Seen::default(),
            kept: Vec::new(),
            recent: Vec::new(),
            repeats: 0,
            next_slot: 0,
        }
    }

    /// Longer heads are decoded every time.
    const MAX_REPEAT: usize = 512;

    /// Heads kept at once: a connection calls a handful of methods, each with its head. A
    /// miss compares a head with this many kept and this many recent ones.
    pub(crate) const MAX_KEPT: usize = 4;

    /// How many packets came with a head repeating a kept one, so were not decoded again.
    pub(crate) fn repeats(&self) -> u64 {
        self.repeats
    }

    /// The packet a whole message of call `call` stands for whose head repeats kept head
    /// `k`, with its body frame: what the general decoder makes of the same message.
    fn expand(&self, k: usize, call: u32, frame: Bytes) -> (Packet, Option<Bytes>) {
        let mut p = Packet::new(call);
        p.head = Some(self.kept[k].head.clone());
        if !self.request {
            p.trailers = Some(Trailers::OkInHead);
        }
        p.end = true;
        (p, Some(frame))
    }

    /// Whether `p` with body frame `frame`, as [`Demux::push`] made it, is the packet the
    /// general decoder made of the same message (`decoded`, its frame still inline): what
    /// the fuzz target and the tests require of every packet.
    pub(crate) fn same_packet(p: &Packet, frame: Option<&Bytes>, decoded: &Packet) -> bool {
        let d = decoded;
        matches!((&d.data, frame), (Some(Data::Inline(a)), Some(b)) if a == b)
            && p.data.is_none()
            && (
                p.call,
                &p.head,
                &p.trailers,
                p.end,
                p.reset,
                p.window,
                p.goaway,
            ) == (
                d.call,
                &d.head,
                &d.trailers,
                d.end,
                d.reset,
                d.window,
                d.goaway,
            )
    }

    /// Keeps a head that came twice, in a free slot or else in the next one in turn.
    fn keep(&mut self, bytes: Vec<u8>, head: Head) {
        let kept = Kept { bytes, head };
        if self.kept.len() < Self::MAX_KEPT {
            self.kept.push(kept);
        } else {
            self.kept[self.next_slot] = kept;
            self.next_slot = (self.next_slot + 1) % Self::MAX_KEPT;
        }
    }

    /// Feeds the next message: its bytes, or a two-part message's head and body
    /// (`Connection::recv_parts`). An error means the peer broke the framing: the
    /// connection cannot go on (the caller closes it).
    pub(crate) fn push(
        &mut self,
        (msg, rest): (Bytes, Option<Bytes>),
    ) -> Result<(Packet, Option<Bytes>)> {
        if let Some(body) = rest {
            // A packet with a large body frame, the message's second part.
            let mut p = Packet::decode_with(msg, self.request, &self.limits, &mut self.seen)?;
            return match p.data.take() {
                Some(Data::Next(len)) if len == body.len() as u64 => Ok((p, Some(body))),
                _ => Err(Error::Protocol(format!(
                    "gRPC call framing: call {}'s packet came with a second part of {} bytes that it does not announce",
                    p.call,
                    body.len()
                ))),
            };
        }
        // A whole unary packet whose head repeats is not decoded again. A head is kept once
        // it came twice among the last few, so heads that change every call (a request id)
        // cost a copy and a few comparisons, and never push out the kept ones.
        let whole = WholeParts::of(&msg, self.request).filter(|w| w.head.len() <= Self::MAX_REPEAT);
        let mut again = None;
        if let Some(w) = &whole {
            let head = &msg[w.head.clone()];
            if let Some(k) = self.kept.iter().position(|k| k.bytes[..] == *head) {
                self.repeats += 1;
                return Ok(self.expand(k, w.call, msg.slice(w.frame.clone())));
            }
            match self.recent.iter().position(|r| r[..] == *head) {
                Some(i) => again = Some(self.recent.remove(i)),
                None => {
                    let mut bytes = if self.recent.len() >= Self::MAX_KEPT {
                        self.recent.remove(0)
                    } else {
                        Vec::new()
                    };
                    bytes.clear();
                    bytes.extend_from_slice(head);
                    self.recent.push(bytes);
                }
            }
        }
        let mut p = Packet::decode_with(msg, self.request, &self.limits, &mut self.seen)?;
        if let Some(bytes) = again
            && let Some(head) = &p.head
            && (self.request || p.trailers == Some(Trailers::OkInHead))
        {
            self.keep(bytes, head.clone());
        }
        match p.data.take() {
            Some(Data::Next(len)) => Err(Error::Protocol(format!(
                "gRPC call framing: call {} announces a body frame of {len} bytes in a second part, but its message has none",
                p.call
            ))),
            Some(Data::Inline(d)) => Ok((p, Some(d))),
            None => Ok((p, None)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grpc::wire::Head;
    use http::HeaderMap;

    fn head(call: u32) -> Packet {
        let mut p = Packet::new(call);
        p.head = Some(Head::Request {
            path: http::uri::PathAndQuery::from_static("/s/m"),
            headers: HeaderMap::new(),
            standard: None,
        });
        p
    }

    #[test]
    fn inline_and_second_part_bodies_come_back_with_their_packets() {
        let mut d = Demux::new(true, Limits::default());
        let mut p = head(1);
        p.data = Some(Data::Inline(Bytes::from_static(b"abc")));
        p.end = true;
        match d.push((p.encode().unwrap(), None)).unwrap() {
            (p, Some(b)) => assert!(p.call == 1 && p.end && b.as_ref() == b"abc"),
            other => panic!("{other:?}"),
        }
        let mut p = head(2);
        p.data = Some(Data::Next(5));
        let body = Bytes::from_static(b"12345");
        match d.push((p.encode().unwrap(), Some(body))).unwrap() {
            (p, Some(b)) => assert!(p.call == 2 && b.as_ref() == b"12345"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_second_part_the_packet_does_not_announce_is_a_framing_error() {
        // Announced, but missing.
        let mut d = Demux::new(true, Limits::default());
        let mut p = head(5);
        p.data = Some(Data::Next(3));
        let e = d.push((p.encode().unwrap(), None)).unwrap_err().to_string();
        assert!(
            e.contains("call 5 announces a body frame of 3 bytes"),
            "{e}"
        );
        // Present, but not announced: a packet with no body, or an inline one.
        let mut d = Demux::new(true, Limits::default());
        let second = Some(Bytes::from_static(b"xyz"));
        let e = d
            .push((head(6).encode().unwrap(), second.clone()))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("call 6's packet came with a second part of 3 bytes")
        );
        let mut p = head(7);
        p.data = Some(Data::Inline(Bytes::from_static(b"abc")));
        assert!(d.push((p.encode().unwrap(), second)).is_err());
    }

    fn whole_request(call: u32, extra: Option<&str>, body: &'static [u8]) -> Bytes {
        let mut p = Packet::new(call);
        let mut headers = HeaderMap::new();
        headers.insert("te", http::HeaderValue::from_static("trailers"));
        if let Some(v) = extra {
            headers.insert("x-extra", http::HeaderValue::from_str(v).unwrap());
        }
        p.head = Some(Head::Request {
            path: http::uri::PathAndQuery::from_static("/s/m"),
            headers,
            standard: None,
        });
        p.data = Some(Data::Inline(Bytes::from_static(body)));
        p.end = true;
        p.encode().unwrap()
    }

    fn whole_answer(call: u32, trailers: Trailers) -> Bytes {
        let mut p = Packet::new(call);
        p.head = Some(Head::Response {
            status: http::StatusCode::OK,
            headers: HeaderMap::new(),
            standard: Some(http::HeaderValue::from_static(
                "Sat, 28 Nov 2026 00:00:00 GMT",
            )),
        });
        p.data = Some(Data::Inline(Bytes::from_static(b"answer")));
        p.trailers = Some(trailers);
        p.end = true;
        p.encode().unwrap()
    }

    /// `d.push(msg)` as a repeat, checked against what the general decoder makes of it:
    /// the packet, and the kept head's slot.
    fn repeat(d: &mut Demux, msg: Bytes) -> (Packet, usize) {
        let fresh = Packet::decode(msg.clone(), d.request, &Limits::default()).unwrap();
        let before = d.repeats();
        let (p, data) = d.push((msg, None)).unwrap();
        assert_eq!(d.repeats(), before + 1, "not a repeat");
        assert!(
            Demux::same_packet(&p, data.as_ref(), &fresh),
            "{p:?} {data:?} against {fresh:?}"
        );
        let slot = d
            .kept
            .iter()
            .position(|k| Some(&k.head) == p.head.as_ref())
            .unwrap();
        (p, slot)
    }

    fn decoded(d: &mut Demux, msg: Bytes) {
        let before = d.repeats();
        d.push((msg, None)).unwrap();
        assert_eq!(d.repeats(), before, "decoded afresh");
    }

    #[test]
    fn a_whole_head_that_came_twice_lately_is_not_decoded_again() {
        let mut d = Demux::new(true, Limits::default());
        let a = |id| whole_request(id, None, b"a");
        decoded(&mut d, a(1));
        decoded(&mut d, a(3));
        let (p, slot) = repeat(&mut d, a(5));
        assert_eq!(p.call, 5);
        // Other packets in between leave the kept head alone: a window grant, a head seen
        // once, a request that is not whole.
        let mut grant = Packet::new(5);
        grant.window = Some(10);
        decoded(&mut d, grant.encode().unwrap());
        decoded(&mut d, whole_request(7, Some("once"), b"d"));
        let mut open =
            Packet::decode(whole_request(9, None, b""), true, &Limits::default()).unwrap();
        open.data = None;
        open.end = false;
        decoded(&mut d, open.encode().unwrap());
        let (_, s) = repeat(&mut d, a(11));
        assert_eq!(s, slot);
        // Heads that take turns (a worker that pushes and pulls) are kept side by side.
        let b = |id| whole_request(id, Some("b"), b"b");
        let c = |id| whole_request(id, Some("c"), b"c");
        for id in [15, 17] {
            decoded(&mut d, b(id));
            decoded(&mut d, c(id + 100));
        }
        for id in [21, 23] {
            assert_ne!(repeat(&mut d, b(id)).1, slot);
            repeat(&mut d, c(id + 100));
            assert_eq!(repeat(&mut d, a(id + 200)).1, slot);
        }
        // Once every slot is taken, a new head takes them in turn, the oldest first.
        let e = |id| whole_request(id, Some("e"), b"e");
        let f = |id| whole_request(id, Some("f"), b"f");
        decoded(&mut d, e(31));
        decoded(&mut d, e(33));
        repeat(&mut d, e(35));
        decoded(&mut d, f(41));
        decoded(&mut d, f(43));
        let (_, f_slot) = repeat(&mut d, f(45));
        assert_eq!(f_slot, slot, "the first slot is taken again");
        decoded(&mut d, a(47));
    }

    #[test]
    fn a_head_that_changes_every_call_or_is_long_is_always_decoded() {
        let mut d = Demux::new(true, Limits::default());
        for i in 0..8 {
            decoded(&mut d, whole_request(2 * i + 1, Some(&i.to_string()), b"x"));
        }
        // More heads taking turns than are remembered: none is seen again in time.
        for i in 0..3 * Demux::MAX_KEPT as u32 {
            let turn = (i % (Demux::MAX_KEPT as u32 + 1)).to_string();
            decoded(&mut d, whole_request(2 * i + 101, Some(&turn), b"x"));
        }
        let long = "v".repeat(Demux::MAX_REPEAT);
        for i in 0..4 {
            decoded(&mut d, whole_request(2 * i + 201, Some(&long), b"x"));
        }
        assert!(d.kept.is_empty());
    }

    #[test]
    fn only_a_whole_direct_answer_with_a_lone_ok_repeats() {
        let mut d = Demux::new(false, Limits::default());
        decoded(&mut d, whole_answer(1, Trailers::Ok));
        decoded(&mut d, whole_answer(3, Trailers::Ok));
        let (p, ..) = repeat(&mut d, whole_answer(5, Trailers::Ok));
        // As the general decoder gives it: the ok trailer merged into the head's map.
        assert_eq!(p.trailers, Some(Trailers::OkInHead));
        let Some(Head::Response { headers, .. }) = &p.head else {
            panic!("a response head")
        };
        assert_eq!(headers["grpc-status"], "0");
        // An ordinary call's answer (even id) keeps its trailer apart; other trailers
        // are decoded.
        decoded(&mut d, whole_answer(2, Trailers::Ok));
        let mut other = HeaderMap::new();
        other.insert("grpc-status", http::HeaderValue::from_static("0"));
        other.insert("grpc-message", http::HeaderValue::from_static("fine"));
        decoded(&mut d, whole_answer(7, Trailers::map(other)));
        repeat(&mut d, whole_answer(9, Trailers::Ok));
        // A request never repeats on the client, nor an answer on the server.
        let mut s = Demux::new(true, Limits::default());
        for id in [1, 3, 5] {
            assert!(s.push((whole_answer(id, Trailers::Ok), None)).is_err());
        }
    }

    #[test]
    fn a_second_part_of_another_length_is_a_framing_error() {
        let mut d = Demux::new(false, Limits::default());
        let mut p = Packet::new(9);
        p.data = Some(Data::Next(100));
        let e = d
            .push((p.encode().unwrap(), Some(Bytes::from_static(b"short"))))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("call 9's packet came with a second part of 5 bytes"),
            "{e}"
        );
    }
}
