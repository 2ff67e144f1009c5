//! `auth_query`: the secret of a client that no `[users]` entry nor auth file lists, looked up
//! in PostgreSQL as PgBouncer does: the query (PgBouncer 1.25's default reads `pg_authid`) runs
//! with the user name as its parameter `$1` (extended protocol, so no quoting is involved) on a
//! server connection of `auth_user`, and its one row's second column is the secret (plain, md5
//! or SCRAM, as `pg_authid` holds it).
//!
//! Answers are kept for [`CACHE_TTL`] per (server database, auth_user, query, user), absent
//! users too, so that a burst of logins costs one query (two databases may share a server
//! database with auth_users or queries of their own: PgBouncer's per-database overrides). No
//! lock is held while a query runs: two logins of the same uncached user may both ask, and
//! the later answer is kept.
//!
//! No row means no such user (the login then fails like a wrong password: 28P01, the same
//! text); so is a NULL secret (an expired or password-less role; PgBouncer stores a secret
//! nothing matches). Two rows, a reply of another shape, or an error from the query are
//! [`LookupError`]s: the login is refused and the reason logged.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::server::{ServerConn, ServerError, ServerTarget};

/// How long an answer of the query is used before it is asked again.
pub const CACHE_TTL: Duration = Duration::from_secs(30);

/// Why the secret of a user could not be looked up.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    /// No connection as auth_user, or an error from the query.
    #[error("{0}")]
    Server(String),
    /// The query answered something else than at most one row of two columns.
    #[error("{0}")]
    Shape(String),
    /// The client asked for a database pgmemo does not serve: nowhere to look.
    #[error("no such database")]
    NoDatabase,
}

/// (server database, auth_user, query, user): what an answer is kept under.
type Key = (String, String, String, String);

/// One answer (the secret, None for no such user) and when it came.
type Answer = (Option<String>, Instant);

/// The answers of auth_query, by (server database, auth_user, query, user).
#[derive(Default)]
pub struct AuthQueryCache {
    answers: Mutex<HashMap<Key, Answer>>,
}

impl AuthQueryCache {
    /// The secret of `user` (None: no such user), from the cache or by running `query` on a
    /// new connection to `target` (which logs in as auth_user).
    pub async fn secret(
        &self,
        target: &ServerTarget,
        query: &str,
        user: &str,
    ) -> Result<Option<String>, LookupError> {
        let key = (
            target.database_id.to_string(),
            target.user.clone(),
            query.to_owned(),
            user.to_owned(),
        );
        if let Some((secret, at)) = self.answers.lock().get(&key) {
            if at.elapsed() < CACHE_TTL {
                return Ok(secret.clone());
            }
        }
        let secret = run(target, query, user).await?;
        let mut answers = self.answers.lock();
        answers.retain(|_, (_, at)| at.elapsed() < CACHE_TTL);
        answers.insert(key, (secret.clone(), Instant::now()));
        Ok(secret)
    }

    /// Forgets every answer (RELOAD: the query or auth_user may have changed).
    pub fn clear(&self) {
        self.answers.lock().clear();
    }
}

/// Connects as auth_user, runs the query with `user` as `$1` and reads its answer.
async fn run(
    target: &ServerTarget,
    query: &str,
    user: &str,
) -> Result<Option<String>, LookupError> {
    let mut conn = ServerConn::connect(target).await.map_err(|e| {
        LookupError::Server(format!("cannot log in as auth_user {:?}: {e}", target.user))
    })?;
    let rows = conn
        .internal_query_with_params(query, &[user])
        .await
        .map_err(|e| match e {
            ServerError::Server { fields, .. } => LookupError::Server(format!(
                "auth_query failed: {} {}",
                fields.code, fields.message
            )),
            e => LookupError::Server(e.to_string()),
        });
    conn.terminate().await;
    shape(rows?)
}

/// The secret in `rows`, the answer of the auth query: none, or one row of (name, secret).
fn shape(rows: Vec<Vec<Option<String>>>) -> Result<Option<String>, LookupError> {
    match rows.as_slice() {
        [] => Ok(None),
        [row] if row.len() == 2 => {
            if row[0].is_none() {
                return Err(LookupError::Shape(
                    "auth_query returned a NULL user name".into(),
                ));
            }
            // NULL: a role that may not log in with a password (or whose password expired):
            // refused as a user without a secret is.
            Ok(row[1].clone())
        }
        [row] => Err(LookupError::Shape(format!(
            "auth_query must return 2 columns (user name, secret), not {}",
            row.len()
        ))),
        _ => Err(LookupError::Shape(format!(
            "auth_query returned {} rows; it must return at most one",
            rows.len()
        ))),
    }
}
