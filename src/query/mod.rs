//! What pgmemo knows about a query's text: every reader of SQL text lives here, and nowhere
//! else, so that a newcomer finds in one room how pgmemo understands what a client sent.
//!
//! - [`lexer`]: one pass over a simple query, PostgreSQL's own lexer rules, that finds its
//!   literals and yields its *shape* (the text with literals as `$n`, and its hash): the hot
//!   path of autoprepare and the result cache's key.
//! - [`words`]: a cheap, generous test for which of a few SQL words a text contains, so the
//!   features that care about a word (session state, DDL, statement commands) look closer only
//!   when it is there.
//! - [`command`]: the SQL-level commands that change what pgmemo tracks (`PREPARE`,
//!   `EXECUTE`, `DEALLOCATE`, `DISCARD`, `SET search_path`, transaction starts and ends).
//! - [`facts`]: what a statement does to its session (settings, temporary objects, `LISTEN`,
//!   advisory locks, held cursors) and to the schema (DDL).
//! - [`hint`]: the `/* pgmemo cache */` comments.
//! - [`analysis`]: what a statement reads and writes, from PostgreSQL's own parser
//!   (pg_query), once per shape on the cold path.
//!
//! This room uses only the ground floor (protocol names, settings' values): the features
//! above it (statements, autoprepare, the cache, the session) all read queries through it.

pub mod analysis;
pub mod command;
pub mod facts;
pub mod hint;
pub mod lexer;
pub mod words;
