//! The datagrams replicas send each other, and their signatures.
//!
//! Every datagram holds entries, each: the peer's address as text (a length byte, then the
//! bytes; every process names peers by the address its configuration gives), a count byte,
//! then that many block names, little-endian `u64`, shallowest first. Before them comes a
//! header:
//!
//! - signed ([`SIGNED_MAGIC`], with `replicas.key_file`): the magic, the key's id (1 byte, see
//!   [`super::keys`]), the sender's id (`u64`, drawn at the sender's start), its sequence
//!   number (`u64`, one more for each datagram it sends) and the time it sent it (`u64`,
//!   milliseconds since the Unix epoch), all little-endian; after the entries, the
//!   HMAC-SHA256 of everything before it under the key ([`TAG_LEN`] bytes). The time lets a
//!   receiver refuse a copy of an old datagram that no window of sequence numbers remembers
//!   (the receiver restarted, or the sender was forgotten among many).
//! - unsigned ([`MAGIC`], replicas on loopback without a key): the magic alone, as before
//!   signatures, so that processes of the two versions still hear each other.

use hmac::Mac;

use super::keys::{Key, KeyRing};

/// The first bytes of an unsigned datagram: its format, version 1.
pub const MAGIC: &[u8; 4] = b"PLR1";

/// The first bytes of a signed datagram: version 3 (version 2 had no time, and is not heard).
pub const SIGNED_MAGIC: &[u8; 4] = b"PLR3";

/// Bytes of a signed datagram's header: magic, key id, sender id, sequence number, time sent.
pub const SIGNED_HEADER: usize = 4 + 1 + 8 + 8 + 8;

/// Bytes of the signature that ends a signed datagram.
pub const TAG_LEN: usize = 32;

/// Bytes of a datagram at most, signature included: one Ethernet frame's payload, so that
/// nothing is fragmented between hosts.
pub const MAX_DATAGRAM: usize = 1400;

/// Who signs a datagram, and which of theirs it is.
#[derive(Clone, Copy)]
pub struct Signing<'a> {
    pub key: &'a Key,
    pub sender: u64,
    pub seq: u64,
    /// When it is sent, in milliseconds since the Unix epoch.
    pub sent_ms: u64,
}

/// Starts a datagram in `out`: unsigned without a key, else signed as `signing` says.
pub fn begin(out: &mut Vec<u8>, signing: Option<Signing<'_>>) {
    out.clear();
    match signing {
        None => out.extend_from_slice(MAGIC),
        Some(s) => {
            out.extend_from_slice(SIGNED_MAGIC);
            out.push(s.key.id());
            out.extend_from_slice(&s.sender.to_le_bytes());
            out.extend_from_slice(&s.seq.to_le_bytes());
            out.extend_from_slice(&s.sent_ms.to_le_bytes());
        }
    }
}

/// Appends one entry to `out`, unless the datagram would pass [`MAX_DATAGRAM`] once signed;
/// false then. Room for the signature is kept unsigned too, so that both hold the same.
pub fn encode_entry(out: &mut Vec<u8>, peer: &str, hashes: &[u64]) -> bool {
    let (Ok(id_len), Ok(n)) = (u8::try_from(peer.len()), u8::try_from(hashes.len())) else {
        return false;
    };
    let size = 2 + peer.len() + 8 * hashes.len();
    if out.len() + size + TAG_LEN > MAX_DATAGRAM {
        return false;
    }
    out.push(id_len);
    out.extend_from_slice(peer.as_bytes());
    out.push(n);
    for h in hashes {
        out.extend_from_slice(&h.to_le_bytes());
    }
    true
}

/// Ends a datagram [`begin`] started signed, with the signature of all of it.
pub fn seal(out: &mut Vec<u8>, key: &Key) {
    let tag = key.mac().chain_update(&out[..]).finalize().into_bytes();
    out.extend_from_slice(&tag);
}

/// Why a datagram is not heard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not signed with any key this process holds: the unsigned format, cut short before its
    /// signature, or signed under a key id it does not have.
    Unsigned,
    /// Its signature does not match its contents under the key its id names.
    Forged,
}

/// A signed datagram whose signature matches.
#[derive(Debug, PartialEq, Eq)]
pub struct Signed<'a> {
    pub sender: u64,
    pub seq: u64,
    pub sent_ms: u64,
    /// The entries, for [`entries`].
    pub body: &'a [u8],
}

/// The entries of an unsigned datagram; `None` without [`MAGIC`].
pub fn unsigned(datagram: &[u8]) -> Option<&[u8]> {
    datagram.strip_prefix(MAGIC.as_slice())
}

/// Checks a signed datagram against `ring`'s keys.
pub fn open<'a>(datagram: &'a [u8], ring: &KeyRing) -> Result<Signed<'a>, Refused> {
    let rest = datagram
        .strip_prefix(SIGNED_MAGIC.as_slice())
        .filter(|_| datagram.len() >= SIGNED_HEADER + TAG_LEN)
        .ok_or(Refused::Unsigned)?;
    let (signed, tag) = datagram.split_at(datagram.len() - TAG_LEN);
    let mut candidates = ring.with_id(rest[0]).peekable();
    candidates.peek().ok_or(Refused::Unsigned)?;
    // Two keys of a rotation may share an id (one in 256): each is tried.
    let genuine = candidates.any(|key| key.mac().chain_update(signed).verify_slice(tag).is_ok());
    if !genuine {
        return Err(Refused::Forged);
    }
    let word = |at: usize| u64::from_le_bytes(datagram[at..at + 8].try_into().expect("8 bytes"));
    Ok(Signed {
        sender: word(5),
        seq: word(13),
        sent_ms: word(21),
        body: &signed[SIGNED_HEADER..],
    })
}

/// The entries of a datagram's body, in order, up to the first that is cut short or not text.
pub fn entries(body: &[u8]) -> impl Iterator<Item = (&str, Vec<u64>)> {
    let mut rest = body;
    std::iter::from_fn(move || {
        let (&id_len, tail) = rest.split_first()?;
        let (id, tail) = tail.split_at_checked(usize::from(id_len))?;
        let id = std::str::from_utf8(id).ok()?;
        let (&n, tail) = tail.split_first()?;
        let (names, tail) = tail.split_at_checked(8 * usize::from(n))?;
        rest = tail;
        let hashes = names
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")))
            .collect();
        Some((id, hashes))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KEY_A: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    const KEY_B: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

    fn ring(text: &str) -> KeyRing {
        KeyRing::parse(text).unwrap()
    }

    fn signing(ring: &KeyRing, sender: u64, seq: u64) -> Signing<'_> {
        Signing {
            key: ring.signer(),
            sender,
            seq,
            sent_ms: 1_796_000_000_000 + seq,
        }
    }

    fn signed_datagram(ring: &KeyRing, sender: u64, seq: u64) -> Vec<u8> {
        let mut d = Vec::new();
        begin(&mut d, Some(signing(ring, sender, seq)));
        assert!(encode_entry(&mut d, "10.0.0.1:8000", &[1, u64::MAX, 3]));
        assert!(encode_entry(&mut d, "[::1]:8001", &[]));
        seal(&mut d, ring.signer());
        d
    }

    #[test]
    fn a_signed_datagram_opens_with_its_sender_sequence_and_entries() {
        let keys = ring(KEY_A);
        let d = signed_datagram(&keys, 0xfeed, 41);
        assert_eq!(&d[..4], b"PLR3");
        assert_eq!(d[4], keys.signer().id());
        let opened = open(&d, &keys).unwrap();
        assert_eq!(
            (opened.sender, opened.seq, opened.sent_ms),
            (0xfeed, 41, 1_796_000_000_041)
        );
        let got: Vec<_> = entries(opened.body).collect();
        assert_eq!(
            got,
            vec![
                ("10.0.0.1:8000", vec![1, u64::MAX, 3]),
                ("[::1]:8001", vec![])
            ]
        );
    }

    #[test]
    fn every_byte_is_covered_by_the_signature() {
        let keys = ring(KEY_A);
        let d = signed_datagram(&keys, 7, 1);
        for at in 0..d.len() {
            let mut tampered = d.clone();
            tampered[at] ^= 0x01;
            let refused = open(&tampered, &keys).unwrap_err();
            // A changed magic or key id no longer names a key of this ring.
            let expected = match at {
                0..=4 => Refused::Unsigned,
                _ => Refused::Forged,
            };
            assert_eq!(refused, expected, "byte {at} changed");
        }
    }

    #[test]
    fn a_datagram_signed_with_another_key_is_refused_and_both_keys_of_a_rotation_are_heard() {
        let (a, b) = (ring(KEY_A), ring(KEY_B));
        let from_a = signed_datagram(&a, 1, 1);
        let from_b = signed_datagram(&b, 2, 1);
        assert_ne!(a.signer().id(), b.signer().id());
        assert_eq!(open(&from_a, &b).unwrap_err(), Refused::Unsigned);
        let rotating = ring(&format!("{KEY_B}\n{KEY_A}\n"));
        assert!(open(&from_a, &rotating).is_ok());
        assert!(open(&from_b, &rotating).is_ok());
        // A key given the id of the ring's own is forged, not unknown.
        let mut lying = from_b.clone();
        lying[4] = a.signer().id();
        assert_eq!(open(&lying, &a).unwrap_err(), Refused::Forged);
    }

    #[test]
    fn unsigned_and_short_datagrams_are_unsigned() {
        let keys = ring(KEY_A);
        let mut plain = MAGIC.to_vec();
        assert!(encode_entry(&mut plain, "a:1", &[5]));
        assert_eq!(open(&plain, &keys).unwrap_err(), Refused::Unsigned);
        let whole = signed_datagram(&keys, 1, 1);
        // Without its tag: what is left is too short, or its last bytes read as a bad tag.
        assert_eq!(
            open(&whole[..SIGNED_HEADER + TAG_LEN - 1], &keys).unwrap_err(),
            Refused::Unsigned
        );
        assert_eq!(
            open(&whole[..whole.len() - TAG_LEN], &keys).unwrap_err(),
            Refused::Forged
        );
        assert_eq!(unsigned(&plain).map(|b| entries(b).count()), Some(1));
        assert_eq!(unsigned(&whole), None);
        // Version 2, without the time, is not a format this process hears.
        let mut old = whole.clone();
        old[..4].copy_from_slice(b"PLR2");
        assert_eq!(open(&old, &keys).unwrap_err(), Refused::Unsigned);
    }

    #[test]
    fn an_entry_that_would_pass_the_datagram_size_is_left_for_the_next() {
        let keys = ring(KEY_A);
        let mut d = Vec::new();
        begin(&mut d, Some(signing(&keys, 1, 1)));
        let names = [7u64; 65];
        assert!(encode_entry(&mut d, "10.0.0.1:8000", &names));
        assert!(encode_entry(&mut d, "10.0.0.1:8000", &names));
        let full = d.len();
        assert!(!encode_entry(&mut d, "10.0.0.1:8000", &names));
        assert_eq!(d.len(), full, "nothing of the refused entry was written");
        // Filled to the brim with small entries, the signed datagram still fits.
        while encode_entry(&mut d, "p:1", &[]) {}
        assert!(d.len() + TAG_LEN > MAX_DATAGRAM - 5);
        seal(&mut d, keys.signer());
        assert!(d.len() <= MAX_DATAGRAM, "{}", d.len());
        assert!(open(&d, &keys).is_ok());
    }

    #[test]
    fn entries_cut_short_yield_what_is_whole() {
        let mut d = Vec::new();
        encode_entry(&mut d, "a:1", &[5]);
        encode_entry(&mut d, "b:2", &[6, 7]);
        d.truncate(d.len() - 3);
        let got: Vec<_> = entries(&d).collect();
        assert_eq!(got, vec![("a:1", vec![5])]);
        assert_eq!(unsigned(b"PLR0\x01a\x00"), None);
    }

    proptest! {
        #[test]
        fn any_bytes_open_and_decode_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..2000)) {
            let keys = ring(KEY_A);
            for magic in [SIGNED_MAGIC, MAGIC] {
                let mut d = magic.to_vec();
                d.extend_from_slice(&bytes);
                prop_assert!(open(&d, &keys).is_err());
            }
            for (id, hashes) in entries(&bytes) {
                prop_assert!(id.len() < 256 && hashes.len() < 256);
            }
        }
    }
}
