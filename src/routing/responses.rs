//! Where a stored Responses API response lives. vLLM keeps the responses it stores in the
//! engine process that made them, so a request naming one (`previous_response_id`) must go
//! back to that engine: any other answers 404. The proxy reads each forwarded response's id
//! from the first bytes of its body ([`IdReader`]) and notes its peer here; a follow-up asks.
//!
//! The map is direct-mapped and fixed in size: an id's hash picks its one slot, and a newer id
//! that lands there takes it. Memory stays bounded (some 60 bytes a slot with its peer's name,
//! under 4 MiB at the default) whatever the traffic, and the ids lost are, on average, the
//! oldest: a conversation names only its latest response, so a follow-up that comes within the
//! last tens of thousands of responses finds its peer. One that does not is routed by its key
//! like any other request.

use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};

use jiter::{Jiter, JiterError};

use super::prompt::is_cut;

/// Responses remembered at once: the responses a busy cluster makes in some minutes.
pub const DEFAULT_CAPACITY: usize = 1 << 16;
/// Locks the slots are spread over, so that learning and asking seldom wait on each other.
const SHARDS: usize = 64;
/// The most of a response body read for its id: vLLM writes `id` first, but a stream's
/// `response.created` event may carry a long `instructions` after it.
pub const READ_LIMIT: usize = 16 * 1024;

type Entry = Option<(u64, Arc<str>)>;

pub struct ResponseHomes {
    shards: Box<[Mutex<Box<[Entry]>>]>,
    per_shard: usize,
    hasher: std::hash::RandomState,
}

impl Default for ResponseHomes {
    fn default() -> Self {
        Self::new(DEFAULT_CAPACITY)
    }
}

impl ResponseHomes {
    /// A map of `capacity` slots (at least one a shard).
    pub fn new(capacity: usize) -> Self {
        let per_shard = capacity.div_ceil(SHARDS).max(1);
        let shards = (0..SHARDS)
            .map(|_| Mutex::new(vec![None; per_shard].into_boxed_slice()))
            .collect();
        Self {
            shards,
            per_shard,
            hasher: std::hash::RandomState::new(),
        }
    }

    /// Notes that the peer `peer` made the response `id`.
    pub fn learn(&self, id: &str, peer: &str) {
        let (hash, shard, slot) = self.place(id);
        let mut slots = shard.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(&slots[slot], Some((h, p)) if *h == hash && **p == *peer) {
            slots[slot] = Some((hash, peer.into()));
        }
    }

    /// The peer that made the response `id`, while it is remembered.
    pub fn home(&self, id: &str) -> Option<Arc<str>> {
        let (hash, shard, slot) = self.place(id);
        let slots = shard.lock().unwrap_or_else(|e| e.into_inner());
        match &slots[slot] {
            Some((h, peer)) if *h == hash => Some(Arc::clone(peer)),
            _ => None,
        }
    }

    fn place(&self, id: &str) -> (u64, &Mutex<Box<[Entry]>>, usize) {
        let hash = self.hasher.hash_one(id);
        let shard = &self.shards[(hash % SHARDS as u64) as usize];
        (
            hash,
            shard,
            ((hash / SHARDS as u64) % self.per_shard as u64) as usize,
        )
    }
}

/// The `previous_response_id` of a Responses request's body, wherever it comes; `None` when
/// there is none or the body is cut before it.
pub fn previous_in(body: &[u8]) -> Option<String> {
    super::prompt::string_field(body, "previous_response_id")
}

/// Reads a response's id from the first bytes of its body, chunk by chunk: the top-level `id`
/// of a JSON response, or `response.id` of the first event of a stream that carries one
/// (`response.created`, then `response.completed`). Keeps at most [`READ_LIMIT`] bytes.
#[derive(Debug, Default)]
pub struct IdReader {
    seen: Vec<u8>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Read {
    Id(String),
    More,
    /// No id within the limit, or a body that is not a response.
    None,
}

impl IdReader {
    pub fn feed(&mut self, chunk: &[u8]) -> Read {
        let room = READ_LIMIT - self.seen.len();
        self.seen.extend_from_slice(&chunk[..chunk.len().min(room)]);
        match id_in(&self.seen) {
            Read::More if self.seen.len() >= READ_LIMIT => Read::None,
            read => read,
        }
    }
}

/// The id in a body's first bytes.
pub fn id_in(body: &[u8]) -> Read {
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        None => Read::More,
        Some(b'{') => string_at(body, &["id"]).unwrap_or_else(|cut| cut),
        Some(_) => event_id(body),
    }
}

/// The `response.id` of the first server-sent event that carries one.
fn event_id(body: &[u8]) -> Read {
    let mut rest = body;
    while let Some(at) = find(rest, b"data:") {
        let line = &rest[at + 5..];
        let (data, ended) = match find(line, b"\n") {
            Some(end) => (&line[..end], true),
            None => (line, false),
        };
        match string_at(data, &["response", "id"]) {
            Ok(Read::Id(id)) => return Read::Id(id),
            Err(Read::More) if !ended => return Read::More,
            _ => {}
        }
        rest = &line[data.len()..];
    }
    Read::More
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The string at `path` through nested objects: `Ok(Id)`, `Ok(None)` when absent or not a
/// string, `Err(More)` when the JSON is cut before it, `Err(None)` when it is malformed.
fn string_at(json: &[u8], path: &[&str]) -> Result<Read, Read> {
    let fail = |e: JiterError| match is_cut(&e, json.len()) {
        true => Read::More,
        false => Read::None,
    };
    let mut j = Jiter::new(json);
    let mut depth = 0;
    let mut key = j.next_object().map_err(fail)?.map(|k| k == path[depth]);
    while let Some(wanted) = key {
        if wanted && depth + 1 == path.len() {
            return match j.next_str() {
                Ok(id) => Ok(Read::Id(id.to_owned())),
                Err(e) if is_cut(&e, json.len()) => Err(Read::More),
                Err(_) => Ok(Read::None),
            };
        }
        if wanted {
            depth += 1;
            key = j.next_object().map_err(fail)?.map(|k| k == path[depth]);
            continue;
        }
        j.next_skip().map_err(fail)?;
        key = j.next_key().map_err(fail)?.map(|k| k == path[depth]);
    }
    Ok(Read::None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_learned_id_leads_to_its_peer_until_a_newer_one_takes_its_slot() {
        let homes = ResponseHomes::new(SHARDS);
        homes.learn("resp_1", "a:1");
        assert_eq!(homes.home("resp_1").as_deref(), Some("a:1"));
        assert_eq!(homes.home("resp_2"), None);
        // With one slot a shard, enough newer ids evict the first.
        for i in 0..10_000 {
            homes.learn(&format!("other_{i}"), "b:1");
        }
        assert_eq!(homes.home("resp_1"), None);
    }

    #[test]
    fn the_id_of_a_json_response_is_read_from_its_first_bytes() {
        let body = br#"{"id":"resp_abc","object":"response","output":[{"a":1}]}"#;
        assert_eq!(id_in(body), Read::Id("resp_abc".into()));
        assert_eq!(id_in(&body[..10]), Read::More);
        assert_eq!(
            id_in(br#"{"object":"response","id":"r"}"#),
            Read::Id("r".into())
        );
        assert_eq!(id_in(br#"{"error":{"id":1}}"#), Read::None);
        assert_eq!(id_in(br#"{"id":1}"#), Read::None);
        assert_eq!(id_in(b"{\"id\" nonsense"), Read::None);
    }

    #[test]
    fn the_id_of_a_stream_is_its_first_response_event() {
        let stream = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_s\",\"status\":\"in_progress\"}}\n\n";
        assert_eq!(id_in(stream.as_bytes()), Read::Id("resp_s".into()));
        assert_eq!(id_in(&stream.as_bytes()[..60]), Read::More);
        let other = "data: {\"type\":\"x\"}\n\ndata: {\"response\":{\"id\":\"r2\"}}\n\n";
        assert_eq!(id_in(other.as_bytes()), Read::Id("r2".into()));
        assert_eq!(id_in(b"data: not json\n\n"), Read::More);
    }

    #[test]
    fn a_reader_gives_up_past_its_limit_and_never_holds_more() {
        let mut reader = IdReader::default();
        assert_eq!(reader.feed(b"{\"pad\":\""), Read::More);
        let pad = vec![b'x'; READ_LIMIT];
        assert_eq!(reader.feed(&pad), Read::None);
        assert!(reader.seen.len() <= READ_LIMIT);
        let mut chunked = IdReader::default();
        assert_eq!(chunked.feed(b"{\"id\":\"resp"), Read::More);
        assert_eq!(chunked.feed(b"_9\"}"), Read::Id("resp_9".into()));
    }
}
