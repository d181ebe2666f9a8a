//! Entry points for the fuzz targets and their seed corpus (`transport/fuzz`): what a peer
//! can send, fed to the gRPC layer's demultiplexer and call table. Not stable API.

use bytes::{Buf, Bytes};

use std::sync::Arc;

use crate::grpc::CallShared;
use crate::grpc::calls::{Admit, CallTable, Entry, Slot, Verdict};
use crate::grpc::demux::Demux;
use crate::grpc::pump::Side;
use crate::grpc::wire::{Limits, Packet};

/// A received transport message: its bytes, or a two-part message's head and body.
pub type Message = (Bytes, Option<Bytes>);

/// Splits a fuzz input into messages: each a u16 (big endian) length and its bytes; with
/// [`SECOND_PART`] set, the low 15 bits are the first part's length and a second part (u16
/// length, bytes) follows. A short tail is the last message.
pub fn split_messages(mut data: &[u8]) -> Vec<Message> {
    fn part(data: &mut &[u8], len: usize) -> Bytes {
        let len = len.min(data.len());
        let b = Bytes::copy_from_slice(&data[..len]);
        *data = &data[len..];
        b
    }
    let mut out = Vec::new();
    while data.len() >= 2 {
        let len = data.get_u16();
        let first = part(&mut data, usize::from(len & !SECOND_PART));
        let rest = (len & SECOND_PART != 0 && data.len() >= 2).then(|| {
            let len = data.get_u16();
            part(&mut data, usize::from(len))
        });
        out.push((first, rest));
    }
    out
}

/// Set in a fuzz input's message length when a second part follows.
pub const SECOND_PART: u16 = 0x8000;

/// The calls a fuzzed client has open, and the fuzzed server's limit.
const CALLS: u32 = 8;

/// Feeds `messages` to a server's (`request`) or client's demultiplexer and call table (a
/// client with calls `0..8` open, odd ones whole unary). Each accepted packet must be what
/// the general decoder makes of its message alone and re-encode to the same packet, and
/// the server's table must keep its limit. Returns the packets before the first framing
/// error, or the broken invariant.
pub fn feed(messages: &[Message], request: bool) -> Result<usize, String> {
    feed_counting(messages, request).map(|(n, _)| n)
}

/// [`feed`], which also says how many packets came with a head repeating a kept one.
pub fn feed_counting(messages: &[Message], request: bool) -> Result<(usize, usize), String> {
    let limits = Limits::default();
    let mut demux = Demux::new(request, limits);
    let side = if request { Side::Server } else { Side::Client };
    let mut table = CallTable::new(side, CALLS as usize);
    if !request {
        // Even ids ordinary calls, odd ones whole unary calls (`wire::whole_unary`).
        for i in 0..CALLS {
            let slot = Fuzzed(CallShared::new());
            let _ = if i % 2 == 0 {
                table.open(slot)
            } else {
                table.open_whole(slot)
            };
        }
    }
    let mut n = 0;
    for m in messages {
        // This message's own packet, decoded with nothing seen before.
        let fresh = Packet::decode(m.0.clone(), request, &limits).ok();
        let before = demux.repeats();
        let (p, data) = match demux.push(m.clone()) {
            Ok(got) => got,
            Err(_) => return Ok((n, demux.repeats() as usize)),
        };
        if demux.repeats() != before {
            // A repeated head must decode exactly as its message alone would.
            let Some(f) = fresh else {
                return Err("a repeat where the general decoder refuses the packet".into());
            };
            if !Demux::same_packet(&p, data.as_ref(), &f) {
                return Err(format!(
                    "a repeat differs from the general decoder's packet: {p:?} {data:?} against {f:?}"
                ));
            }
        } else if fresh.as_ref().is_some_and(|f| f.head != p.head) {
            return Err("a head decodes differently after others".into());
        }
        let once = p
            .encode()
            .map_err(|e| format!("an accepted packet does not re-encode: {e}"))?;
        let again = Packet::decode(once.clone(), request, &limits)
            .map_err(|e| format!("a re-encoded packet does not decode: {e}"))?
            .encode()
            .map_err(|e| format!("a decoded packet does not re-encode: {e}"))?;
        if once != again {
            return Err("re-encoding is not stable".into());
        }
        n += 1;
        if !to_table(&mut table, p, data.as_ref().map(Bytes::len), request)? {
            return Ok((n, demux.repeats() as usize));
        }
    }
    Ok((n, demux.repeats() as usize))
}

struct Fuzzed(Arc<CallShared>);

impl Slot for Fuzzed {
    fn call(&self) -> &CallShared {
        &self.0
    }
}

/// What a side does with a packet's call state; false where the connection ends.
fn to_table(
    table: &mut CallTable<Fuzzed>,
    p: Packet,
    len: Option<usize>,
    request: bool,
) -> Result<bool, String> {
    if request && p.head.is_some() {
        match table.admit(p.call) {
            Err(_) => return Ok(false),
            Ok(Admit::Refuse(_)) => return Ok(true),
            Ok(Admit::Open) => table.insert(p.call, Fuzzed(CallShared::new())),
        }
    }
    let ended = match table.packet(&p, len) {
        Verdict::Overrun(_) => return Ok(!request),
        Verdict::Call(Entry::Cancelled(c)) => Some(c.0.clone()),
        _ => None,
    };
    // A cancelled handler's future is gone at once here.
    if let Some(c) = ended {
        table.end(p.call, &c);
    }
    if table.len() > CALLS as usize {
        return Err("the server's table went past its limit on calls".into());
    }
    Ok(true)
}
