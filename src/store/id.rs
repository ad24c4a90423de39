//! The identity of a stored key: upstream, credential scope and key, shared and hashed once.

/// The identity of a stored key, shared: a request's key is held by its context, the replay
/// cache's maps and the writer's jobs at once, and each of those takes a reference, not three
/// strings of its own.
///
/// Its hash is computed once, when it is made, with a process-wide random key: the maps it is
/// kept in hash it again on every look-up, insert and eviction (and all of a shard's keys when
/// the shard's table is rebuilt), and each of those would otherwise walk its three strings —
/// cold in memory by the time the replay cache evicts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopedKey(std::sync::Arc<KeyParts>);

/// What names a stored key (see [`ScopedKey`]).
#[derive(Debug, PartialEq, Eq)]
pub struct KeyParts {
    /// The parts' hash (compared first: keys that differ rarely share it).
    hash: u64,
    pub upstream: String,
    /// Hex SHA-256 of the credential headers.
    pub scope: String,
    pub key: String,
}

/// The key of the parts' hash: random per process, so no caller can choose keys that
/// collide (the maps add keys of their own on top).
static KEY_HASH: std::sync::LazyLock<ahash::RandomState> =
    std::sync::LazyLock::new(ahash::RandomState::new);

impl std::hash::Hash for ScopedKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.0.hash);
    }
}

impl Default for ScopedKey {
    fn default() -> ScopedKey {
        ScopedKey::new(String::new(), String::new(), String::new())
    }
}

impl std::ops::Deref for ScopedKey {
    type Target = KeyParts;
    fn deref(&self) -> &KeyParts {
        &self.0
    }
}

impl ScopedKey {
    pub fn new(
        upstream: impl Into<String>,
        scope: impl Into<String>,
        key: impl Into<String>,
    ) -> ScopedKey {
        let (upstream, scope, key) = (upstream.into(), scope.into(), key.into());
        ScopedKey(std::sync::Arc::new(KeyParts {
            hash: KEY_HASH.hash_one((&upstream, &scope, &key)),
            upstream,
            scope,
            key,
        }))
    }

    /// The same upstream and key under another credential scope.
    pub fn with_scope(&self, scope: impl Into<String>) -> ScopedKey {
        ScopedKey::new(self.upstream.clone(), scope, self.key.clone())
    }

    /// `prefix`, then upstream, scope and key on lines of their own: the key as one name (a
    /// lock's, a notification topic's). Built by hand, not with `format!`: every request
    /// names its key once or twice.
    pub fn joined(&self, prefix: &str) -> String {
        let parts = [self.upstream.as_str(), &self.scope, &self.key];
        let mut out =
            String::with_capacity(prefix.len() + parts.iter().map(|p| p.len() + 1).sum::<usize>());
        out.push_str(prefix);
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                out.push('\n');
            }
            out.push_str(part);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Equal parts make equal keys with equal hashes however they were made, and a key under
    /// another scope is another key: the maps find the one and never confuse the other.
    #[test]
    fn keys_are_their_parts() {
        let a = ScopedKey::new("api", "s1", "k");
        let b = ScopedKey::new("api", "s2", "k").with_scope("s1");
        assert_eq!(a, b);
        let other = a.with_scope("s2");
        assert_ne!(a, other);
        let set: HashSet<ScopedKey> = [a.clone(), b, other.clone()].into_iter().collect();
        assert_eq!(set.len(), 2);
        assert!(set.contains(&a) && set.contains(&other));
        assert_eq!(ScopedKey::default(), ScopedKey::new("", "", ""));
    }
}
