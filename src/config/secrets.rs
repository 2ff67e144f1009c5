//! Users' secrets: what kind of secret a `password` string holds (a plain password, an md5
//! hash or a SCRAM verifier, by PostgreSQL's own rules), and whether a hash is well formed.

/// What kind of secret a user's `password` string holds, following PostgreSQL's own rules
/// for `pg_authid.rolpassword`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretKind {
    /// The password itself.
    Plain,
    /// `md5` followed by 32 hex digits: md5(password || username).
    Md5,
    /// `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`, as in `pg_authid`.
    ScramSha256,
}

impl SecretKind {
    /// Classifies a secret, or says why a string that looks like a hash is not a valid one.
    pub fn of(secret: &str) -> Result<SecretKind, String> {
        if let Some(rest) = secret.strip_prefix("SCRAM-SHA-256$") {
            return check_scram_verifier(rest).map(|()| SecretKind::ScramSha256);
        }
        if secret.len() == 35 && secret.starts_with("md5") {
            return if secret[3..].bytes().all(|b| b.is_ascii_hexdigit()) {
                Ok(SecretKind::Md5)
            } else {
                Err("looks like an md5 hash (\"md5\" + 32 characters) but is not hex".into())
            };
        }
        Ok(SecretKind::Plain)
    }
}

fn check_scram_verifier(rest: &str) -> Result<(), String> {
    const SHAPE: &str =
        "malformed SCRAM verifier; expected SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey> as in pg_authid";
    let bad = |what: &str| format!("{SHAPE} ({what})");
    let (iter_salt, keys) = rest.split_once('$').ok_or_else(|| bad("no second '$'"))?;
    let (iterations, salt) = iter_salt
        .split_once(':')
        .ok_or_else(|| bad("no ':' between iterations and salt"))?;
    match iterations.parse::<u32>() {
        Ok(n) if n > 0 => {}
        _ => return Err(bad("iterations is not a positive integer")),
    }
    match base64_len(salt) {
        Some(n) if n > 0 => {}
        _ => return Err(bad("salt is not base64")),
    }
    let (stored, server) = keys
        .split_once(':')
        .ok_or_else(|| bad("no ':' between StoredKey and ServerKey"))?;
    if base64_len(stored) != Some(32) || base64_len(server) != Some(32) {
        return Err(bad("StoredKey and ServerKey must be 32 bytes in base64"));
    }
    Ok(())
}

/// The decoded length of standard, padded base64, or None when `s` is not that.
fn base64_len(s: &str) -> Option<usize> {
    if !s.len().is_multiple_of(4) {
        return None;
    }
    let body = s.trim_end_matches('=');
    let padding = s.len() - body.len();
    if padding > 2
        || !body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
    {
        return None;
    }
    Some(s.len() / 4 * 3 - padding)
}
