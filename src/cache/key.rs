//! Store keys that carry their hash: a miss hashes its key once, for the store's lookup, its
//! single-flight registration, its admission bit and (when admitted) the store's insert,
//! instead of once per use (a key is the client's context and the query's text and values,
//! ~100 bytes for a point select).

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::LazyLock;

/// The store's hasher: seeded at random once per process (keys carry client-chosen values,
/// so a fixed seed would let a client craft keys that collide), the same for every lookup.
static STORE_HASHER: LazyLock<foldhash::fast::RandomState> = LazyLock::new(Default::default);

/// A stored key: its bytes and their hash ([`KeyRef::new`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    hash: u64,
    bytes: Box<[u8]>,
}

impl Key {
    /// The key of `bytes` whose hash, `KeyRef::new(&bytes).hash`, was taken before.
    pub fn with_hash(hash: u64, bytes: Box<[u8]>) -> Key {
        Key { hash, bytes }
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }
}

/// A key being looked up, borrowed from the client's buffer.
#[derive(Clone, Copy)]
pub struct KeyRef<'a> {
    pub hash: u64,
    bytes: &'a [u8],
}

impl<'a> KeyRef<'a> {
    pub fn new(bytes: &'a [u8]) -> KeyRef<'a> {
        KeyRef {
            hash: STORE_HASHER.hash_one(bytes),
            bytes,
        }
    }

    #[cfg(test)]
    pub fn to_key(self) -> Key {
        Key {
            hash: self.hash,
            bytes: self.bytes.into(),
        }
    }
}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl Hash for KeyRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl quick_cache::Equivalent<Key> for KeyRef<'_> {
    fn equivalent(&self, key: &Key) -> bool {
        self.hash == key.hash && self.bytes == &*key.bytes
    }
}

/// Hashes a key that is already a hash (a [`Key`], a `u64`) to itself.
#[derive(Clone, Copy, Default)]
pub struct KeyIsHash;

impl BuildHasher for KeyIsHash {
    type Hasher = IdentityHasher;
    fn build_hasher(&self) -> IdentityHasher {
        IdentityHasher(0)
    }
}

pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed here; anything else is folded in, not lost.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[cfg(test)]
mod tests {
    use super::{KeyIsHash, KeyRef};
    use quick_cache::Equivalent;
    use std::hash::BuildHasher;

    #[test]
    fn a_key_and_its_reference_hash_and_compare_alike() {
        let (a, b) = (
            KeyRef::new(b"db\0SELECT $1\0"),
            KeyRef::new(b"db\0SELECT $2\0"),
        );
        let key = a.to_key();
        assert_eq!(KeyIsHash.hash_one(&key), KeyIsHash.hash_one(a));
        assert_eq!(KeyIsHash.hash_one(a), a.hash);
        assert!(a.equivalent(&key));
        assert!(!b.equivalent(&key));
        // The same hash with other bytes (a collision) is another key.
        let forged = KeyRef { hash: a.hash, ..b };
        assert!(!forged.equivalent(&key));
    }
}
