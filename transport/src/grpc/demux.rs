//! The inbound half of the call framing, sans IO: turns the connection's transport messages
//! back into packets with their body frames. Client and server share it, and any task
//! that reads the connection feeds the one instance a connection has, so a packet whose
//! body is still to come survives a change of reader.

use bytes::Bytes;

use super::MAX_SEPARATE_BODY;
use super::wire::{Data, Limits, Packet, Seen};
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
}

impl Demux {
    pub(crate) fn new(request: bool, limits: Limits) -> Demux {
        Demux {
            request,
            limits,
            partial: None,
            seen: Seen::default(),
        }
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
        let mut p = Packet::decode_with(msg, self.request, &self.limits, &mut self.seen)?;
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
