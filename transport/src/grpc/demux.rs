//! The inbound half of the call framing, sans IO: turns the connection's transport messages
//! back into packets with their body frames. Client and server share it, and any task
//! that reads the connection feeds the one instance a connection has, so a packet whose
//! body is still to come survives a change of reader.

use bytes::Bytes;

use super::MAX_SEPARATE_BODY;
use super::wire::{Data, Head, Limits, Packet, Seen, Trailers, WholeParts};
use crate::error::{Error, Result};

/// What one transport message completed.
#[derive(Debug)]
pub(crate) enum Got {
    /// Nothing yet: the message announced a body that travels as the next message.
    Nothing,
    /// One packet, with its body frame if it had one.
    One(Packet, Option<Bytes>),
    /// A packet whose separate body the sender's transport refused, and the abort of the
    /// call that the sender put in the body's place (only this call fails).
    Aborted(Packet, Box<Packet>),
    /// A whole unary packet (see [`WholeParts`]) of call `.0` with body frame `.1`, whose
    /// head is byte for byte the one [`Demux::repeated`] holds: it was not decoded again.
    /// [`Demux::expand`] makes it the packet the general decoder would have made.
    Repeat(u32, Bytes),
}

/// Reassembles packets from one connection's messages, in order.
#[derive(Debug)]
pub(crate) struct Demux {
    /// True on the server: packets carry request heads.
    request: bool,
    limits: Limits,
    /// A packet waiting for its body, which is the next message on the connection.
    partial: Option<(Packet, u64)>,
    seen: Seen,
    /// The head of the last whole unary packets once it came twice in a row: its bytes
    /// and what they decoded to (an answer's with its `grpc-status: 0` merged in, see
    /// `Trailers::OkInHead`).
    repeat: Option<(Vec<u8>, Head)>,
    /// The head block of the last whole unary packet, until it repeats.
    last_whole: Vec<u8>,
    /// Counts the heads `repeat` has held: what a side derives from the head (the
    /// server's route for its path) holds while the count stays the same.
    generation: u64,
}

impl Demux {
    pub(crate) fn new(request: bool, limits: Limits) -> Demux {
        Demux {
            request,
            limits,
            partial: None,
            seen: Seen::default(),
            repeat: None,
            last_whole: Vec::new(),
            generation: 0,
        }
    }

    /// Longer heads are decoded every time.
    const MAX_REPEAT: usize = 512;

    /// The head that [`Got::Repeat`] stands for, and its generation.
    pub(crate) fn repeated(&self) -> Option<(&Head, u64)> {
        self.repeat.as_ref().map(|(_, h)| (h, self.generation))
    }

    /// The packet that a [`Got::Repeat`] of call `call` stands for, with its body frame.
    pub(crate) fn expand(&self, call: u32, frame: Bytes) -> Option<(Packet, Option<Bytes>)> {
        let (head, _) = self.repeated()?;
        let mut p = Packet::new(call);
        p.head = Some(head.clone());
        if !self.request {
            p.trailers = Some(Trailers::OkInHead);
        }
        p.end = true;
        Some((p, Some(frame)))
    }

    /// Whether `p` with body frame `frame`, as [`Demux::expand`] made it, is the packet
    /// the general decoder made of the same message (`decoded`, its frame still inline):
    /// what the fuzz target and the tests require of every repeat.
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

    /// Whether the next message is the body of a packet already pushed.
    pub(crate) fn awaits_body(&self) -> bool {
        self.partial.is_some()
    }

    /// Feeds the next message. An error means the peer broke the framing: the connection
    /// cannot go on (the caller closes it).
    pub(crate) fn push(&mut self, msg: Bytes) -> Result<Got> {
        if let Some((packet, len)) = self.partial.take() {
            if msg.len() as u64 == len {
                return Ok(Got::One(packet, Some(msg)));
            }
            return match Packet::decode_with(msg, self.request, &self.limits, &mut self.seen) {
                Ok(abort) if abort.call == packet.call && abort.data.is_none() => {
                    Ok(Got::Aborted(packet, Box::new(abort)))
                }
                _ => Err(Error::Protocol(format!(
                    "gRPC call framing: expected a body of {len} bytes for call {}",
                    packet.call
                ))),
            };
        }
        // A whole unary packet whose head repeats is not decoded again. A head is kept once
        // it came twice in a row, so a connection whose heads change on every call (a
        // request id, a trace context) pays a copy of each head, not a map.
        let whole = WholeParts::of(&msg, self.request).filter(|w| w.head.len() <= Self::MAX_REPEAT);
        let mut again = false;
        if let Some(w) = &whole {
            let head = &msg[w.head.clone()];
            if let Some((kept, _)) = &self.repeat
                && kept[..] == *head
            {
                return Ok(Got::Repeat(w.call, msg.slice(w.frame.clone())));
            }
            again = self.last_whole[..] == *head;
            if !again {
                self.last_whole.clear();
                self.last_whole.extend_from_slice(head);
            }
        }
        let mut p = Packet::decode_with(msg, self.request, &self.limits, &mut self.seen)?;
        if again
            && let Some(head) = &p.head
            && (self.request || p.trailers == Some(Trailers::OkInHead))
        {
            self.repeat = Some((std::mem::take(&mut self.last_whole), head.clone()));
            self.generation += 1;
        }
        match p.data.take() {
            Some(Data::Next(len)) if len > MAX_SEPARATE_BODY => Err(Error::Protocol(format!(
                "gRPC call framing: call {} announces a body frame of {len} bytes; senders cut \
                 bodies into frames of at most {MAX_SEPARATE_BODY} bytes",
                p.call
            ))),
            Some(Data::Next(len)) => {
                self.partial = Some((p, len));
                Ok(Got::Nothing)
            }
            Some(Data::Inline(d)) => Ok(Got::One(p, Some(d))),
            None => Ok(Got::One(p, None)),
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
    fn inline_and_separate_bodies_come_back_with_their_packets() {
        let mut d = Demux::new(true, Limits::default());
        let mut p = head(1);
        p.data = Some(Data::Inline(Bytes::from_static(b"abc")));
        p.end = true;
        match d.push(p.encode().unwrap()).unwrap() {
            Got::One(p, Some(b)) => assert!(p.call == 1 && p.end && b.as_ref() == b"abc"),
            other => panic!("{other:?}"),
        }
        let mut p = head(2);
        p.data = Some(Data::Next(5));
        assert!(matches!(d.push(p.encode().unwrap()).unwrap(), Got::Nothing));
        match d.push(Bytes::from_static(b"12345")).unwrap() {
            Got::One(p, Some(b)) => assert!(p.call == 2 && b.as_ref() == b"12345"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_body_frame_larger_than_any_sender_cuts_is_refused_at_once() {
        let mut d = Demux::new(true, Limits::default());
        let mut p = head(5);
        p.data = Some(Data::Next(MAX_SEPARATE_BODY + 1));
        let e = d.push(p.encode().unwrap()).unwrap_err().to_string();
        assert!(e.contains("body frame of"), "{e}");
    }

    #[test]
    fn an_abort_in_place_of_the_body_fails_only_that_call() {
        let mut d = Demux::new(true, Limits::default());
        let mut p = head(3);
        p.data = Some(Data::Next(MAX_SEPARATE_BODY));
        d.push(p.encode().unwrap()).unwrap();
        let mut abort = Packet::new(3);
        abort.reset = true;
        match d.push(abort.encode().unwrap()).unwrap() {
            Got::Aborted(p, a) => assert!(p.call == 3 && a.reset),
            other => panic!("{other:?}"),
        }
        // The framing goes on.
        assert!(matches!(
            d.push(head(4).encode().unwrap()).unwrap(),
            Got::One(..)
        ));
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

    /// `d.push(msg)` as a repeat, checked against what the general decoder makes of it.
    fn repeat(d: &mut Demux, msg: Bytes) -> Packet {
        let fresh = Packet::decode(msg.clone(), d.request, &Limits::default()).unwrap();
        let Got::Repeat(id, frame) = d.push(msg).unwrap() else {
            panic!("not a repeat")
        };
        let (p, data) = d.expand(id, frame).unwrap();
        assert!(
            Demux::same_packet(&p, data.as_ref(), &fresh),
            "{p:?} {data:?} against {fresh:?}"
        );
        p
    }

    fn decoded(d: &mut Demux, msg: Bytes) {
        assert!(
            matches!(d.push(msg).unwrap(), Got::One(..)),
            "decoded afresh"
        );
    }

    #[test]
    fn a_whole_head_that_came_twice_in_a_row_is_not_decoded_again() {
        let mut d = Demux::new(true, Limits::default());
        decoded(&mut d, whole_request(1, None, b"a"));
        decoded(&mut d, whole_request(3, None, b"b"));
        assert!(d.repeated().is_some());
        let p = repeat(&mut d, whole_request(5, None, b"c"));
        assert_eq!(p.call, 5);
        let (_, generation) = d.repeated().unwrap();
        // Other packets in between leave the kept head alone: a window grant, another
        // head seen once, a request that is not whole.
        let mut grant = Packet::new(5);
        grant.window = Some(10);
        decoded(&mut d, grant.encode().unwrap());
        decoded(&mut d, whole_request(7, Some("once"), b"d"));
        let mut open =
            Packet::decode(whole_request(9, None, b""), true, &Limits::default()).unwrap();
        open.data = None;
        open.end = false;
        decoded(&mut d, open.encode().unwrap());
        repeat(&mut d, whole_request(11, None, b"e"));
        assert_eq!(d.repeated().unwrap().1, generation);
        // A new head twice in a row takes the old one's place, with a new generation.
        decoded(&mut d, whole_request(13, Some("new"), b"f"));
        decoded(&mut d, whole_request(15, Some("new"), b"g"));
        repeat(&mut d, whole_request(17, Some("new"), b"h"));
        assert_eq!(d.repeated().unwrap().1, generation + 1);
        decoded(&mut d, whole_request(19, None, b"i"));
    }

    #[test]
    fn a_head_that_changes_every_call_or_is_long_is_always_decoded() {
        let mut d = Demux::new(true, Limits::default());
        for i in 0..4 {
            decoded(&mut d, whole_request(2 * i + 1, Some(&i.to_string()), b"x"));
        }
        let long = "v".repeat(Demux::MAX_REPEAT);
        for i in 0..4 {
            decoded(&mut d, whole_request(2 * i + 11, Some(&long), b"x"));
        }
        assert!(d.repeated().is_none());
    }

    #[test]
    fn only_a_whole_direct_answer_with_a_lone_ok_repeats() {
        let mut d = Demux::new(false, Limits::default());
        decoded(&mut d, whole_answer(1, Trailers::Ok));
        decoded(&mut d, whole_answer(3, Trailers::Ok));
        let p = repeat(&mut d, whole_answer(5, Trailers::Ok));
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
            assert!(s.push(whole_answer(id, Trailers::Ok)).is_err());
        }
    }

    #[test]
    fn a_wrong_body_is_a_framing_error() {
        let mut d = Demux::new(false, Limits::default());
        let mut p = Packet::new(9);
        p.data = Some(Data::Next(100));
        d.push(p.encode().unwrap()).unwrap();
        let e = d.push(Bytes::from_static(b"short")).unwrap_err();
        assert!(
            e.to_string()
                .contains("expected a body of 100 bytes for call 9"),
            "{e}"
        );
    }
}
