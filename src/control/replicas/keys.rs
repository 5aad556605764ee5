//! The keys replicas sign their datagrams with, from `replicas.key_file`: one key, or two while
//! they are rotated, each a line of hex (blank lines and lines starting with `#` aside). The
//! first signs; a datagram signed with either is heard, so that replicas can take a new key
//! one at a time. The file is read again when it changes and on SIGHUP, as the API keys are.
//!
//! A key's id, which a datagram carries so that the receiver knows which key to check it with
//! without trying each, is the first byte of the key's SHA-256: written by no one, it cannot
//! disagree between replicas, and it stays the key's own when the lines are swapped.

use std::path::Path;
use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::control::watch::{SettledFile, Watched};
use crate::error::Error;

/// Bytes of a key at least: as many as the digest, below which HMAC-SHA256 is weaker than
/// its hash.
pub const MIN_KEY_BYTES: usize = 32;

/// Keys a file may hold: the one in use and, while rotating, the other.
const MAX_KEYS: usize = 2;

/// One key, ready to sign with.
pub struct Key {
    id: u8,
    /// HMAC-SHA256 keyed once, cloned for each datagram.
    mac: Hmac<Sha256>,
}

impl Key {
    fn new(secret: &[u8]) -> Self {
        Self {
            id: Sha256::digest(secret)[0],
            mac: Hmac::new_from_slice(secret).expect("HMAC takes a key of any length"),
        }
    }

    pub fn id(&self) -> u8 {
        self.id
    }

    pub fn mac(&self) -> Hmac<Sha256> {
        self.mac.clone()
    }
}

/// The keys of the file, the one that signs first; never empty.
pub struct KeyRing {
    keys: Vec<Key>,
}

/// The keys' ids alone: nothing that prints a ring shows a secret.
impl std::fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<u8> = self.keys.iter().map(Key::id).collect();
        f.debug_struct("KeyRing").field("ids", &ids).finish()
    }
}

impl KeyRing {
    pub fn parse(text: &str) -> Result<Self, Error> {
        let mut keys = Vec::with_capacity(MAX_KEYS);
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = format!("line {}", i + 1);
            let secret = hex(line)
                .ok_or_else(|| Error::new(&at, "not a key: a key is hex digits (two per byte)"))?;
            if secret.len() < MIN_KEY_BYTES {
                return Err(Error::new(
                    &at,
                    format!(
                        "a key of {} bytes is too short: at least {MIN_KEY_BYTES} random bytes are needed (head -c 32 /dev/urandom | xxd -p -c 64)",
                        secret.len()
                    ),
                ));
            }
            keys.push(Key::new(&secret));
        }
        match keys.len() {
            0 => Err(Error::new("", "holds no key")),
            1..=MAX_KEYS => Ok(Self { keys }),
            n => Err(Error::new(
                "",
                format!("holds {n} keys: one, or two while rotating"),
            )),
        }
    }

    /// The key this process signs with.
    pub fn signer(&self) -> &Key {
        &self.keys[0]
    }

    /// The keys that go by `id`.
    pub fn with_id(&self, id: u8) -> impl Iterator<Item = &Key> {
        self.keys.iter().filter(move |k| k.id == id)
    }
}

fn hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    text.as_bytes()
        .chunks_exact(2)
        .map(|pair| {
            let digit = |c: u8| char::from(c).to_digit(16);
            Some((digit(pair[0])? * 16 + digit(pair[1])?) as u8)
        })
        .collect()
}

/// The key file, kept in step with the keys every part of the exchange reads.
pub struct KeyFile {
    file: SettledFile,
    keys: Arc<ArcSwap<KeyRing>>,
}

impl KeyFile {
    /// Reads the keys before serving: a file that holds none stops the start.
    pub fn load(path: &Path) -> Result<Self, String> {
        let fail = |e: &dyn std::fmt::Display| format!("replicas.key_file {}: {e}", path.display());
        let text = std::fs::read_to_string(path).map_err(|e| fail(&e))?;
        let ring = KeyRing::parse(&text).map_err(|e| fail(&e))?;
        let mut file = SettledFile::new(path.to_owned());
        file.mark_read(text);
        Ok(Self {
            file,
            keys: Arc::new(ArcSwap::from_pointee(ring)),
        })
    }

    pub fn keys(&self) -> Arc<ArcSwap<KeyRing>> {
        Arc::clone(&self.keys)
    }
}

#[async_trait]
impl Watched for KeyFile {
    fn kind(&self) -> &'static str {
        "replica_keys"
    }

    fn label(&self) -> String {
        format!("replica keys {}", self.file.path().display())
    }

    async fn check(&mut self, force: bool) -> Result<bool, Error> {
        let Some(text) = self.file.changed(force).await? else {
            return Ok(false);
        };
        let ring = KeyRing::parse(&text)?;
        log::info!(
            "{}: now {} keys, signing with key id {}",
            self.label(),
            ring.keys.len(),
            ring.signer().id
        );
        self.keys.store(Arc::new(ring));
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    #[test]
    fn keys_are_hex_of_at_least_32_bytes_one_or_two_of_them() {
        let one = KeyRing::parse(&format!("# the replicas' key\n\n  {KEY}  \n")).unwrap();
        assert_eq!(one.keys.len(), 1);
        let upper = KeyRing::parse(&KEY.to_uppercase()).unwrap();
        assert_eq!(upper.signer().id(), one.signer().id());
        let other = format!("{}00", &KEY[2..]);
        let two = KeyRing::parse(&format!("{other}\n{KEY}\n")).unwrap();
        assert_eq!(two.keys.len(), 2);
        assert_eq!(two.keys[1].id(), one.signer().id(), "ids follow the key");
        assert_eq!(two.with_id(one.signer().id()).count(), 1);

        let refused = |text: &str| KeyRing::parse(text).unwrap_err().to_string();
        let short = refused(&format!("{KEY}\n{}\n", &KEY[..62]));
        assert!(
            short.starts_with("line 2: a key of 31 bytes is too short"),
            "{short}"
        );
        assert!(refused(&KEY.replace('0', "g")).contains("not a key"));
        assert!(refused(&KEY[1..]).contains("not a key"));
        assert_eq!(refused("# nothing\n"), "holds no key");
        assert!(refused(&format!("{KEY}\n{KEY}\n{KEY}\n")).contains("holds 3 keys"));
    }
}
