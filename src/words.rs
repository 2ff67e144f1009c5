//! A cheap, generous test for which of a few SQL words a text contains: run once on every
//! simple query ([`in_query`]), its answer shared by the statement planner and the
//! session-state watch, which then decide exactly what a query that contains one of their
//! words does.
//!
//! One pass over the text with a table lookup per byte; the words are compared only where one
//! of them could start (a byte that begins one, not inside an identifier). A word matches as a
//! prefix, in any case: `temp` is found in `TEMPORARY` (and in `temperature`, which costs the
//! caller an exact check, never a wrong answer). Words marked whole ([`WordSet::whole`]) match
//! only as whole words: `create` is not found in `created_at`, a column of every other table.

/// Up to 31 words; word `i` is bit `1 << i` of the sets [`WordSet::found_in`] returns.
pub struct WordSet<const N: usize> {
    words: [&'static [u8]; N],
    /// For each byte: the words that start with it (either case), and [`IDENTIFIER`] when it
    /// continues an identifier (a letter, `_`, a non-ASCII byte): no word starts right after
    /// such a byte.
    class: [u32; 256],
    /// The words that must not be followed by an identifier's byte or a digit.
    whole: u32,
}

const IDENTIFIER: u32 = 1 << 31;

impl<const N: usize> WordSet<N> {
    /// The set of `words` (lower case).
    pub const fn new(words: [&'static [u8]; N]) -> Self {
        assert!(N < 32, "at most 31 words");
        let mut class = [0u32; 256];
        let mut c = 0;
        while c < 256 {
            let b = c as u8;
            if b.is_ascii_alphabetic() || b == b'_' || b >= 0x80 {
                class[c] = IDENTIFIER;
            }
            c += 1;
        }
        let mut i = 0;
        while i < N {
            let first = words[i][0];
            class[first as usize] |= 1 << i;
            class[first.to_ascii_uppercase() as usize] |= 1 << i;
            i += 1;
        }
        WordSet {
            words,
            class,
            whole: 0,
        }
    }

    /// The same set, the words in `whole` matching only as whole words.
    pub const fn whole(mut self, whole: u32) -> Self {
        self.whole = whole;
        self
    }

    /// Which of the `wanted` words `text` contains where a word may start.
    pub fn found_in(&self, text: &[u8], wanted: u32) -> u32 {
        let wanted = wanted & !IDENTIFIER;
        let mut found = 0u32;
        // `IDENTIFIER` set in `after`: the previous byte continues an identifier.
        let mut after = 0; // nothing before the start
        for (at, &c) in text.iter().enumerate() {
            let class = self.class[c as usize];
            let mut candidates = class & wanted & !found;
            if candidates != 0 && after == 0 {
                let rest = &text[at..];
                // Only the words that start with this byte.
                while candidates != 0 {
                    let i = candidates.trailing_zeros() as usize;
                    candidates &= candidates - 1;
                    let word = self.words[i];
                    if rest.len() >= word.len()
                        && rest[..word.len()].eq_ignore_ascii_case(word)
                        && (self.whole & (1 << i) == 0
                            || rest.get(word.len()).is_none_or(|&next| {
                                self.class[next as usize] & IDENTIFIER == 0
                                    && !next.is_ascii_digit()
                            }))
                    {
                        found |= 1 << i;
                    }
                }
            }
            after = class & IDENTIFIER;
        }
        found
    }
}

/// The words looked for in every simple query; bit `1 << i` of [`in_query`]'s answer is word
/// `i` of [`query::WORDS`].
pub mod query {
    use super::WordSet;

    // The statement planner's (see `session::planner::Words`).
    pub const BEGIN: u32 = 1;
    pub const START: u32 = 1 << 1;
    pub const PREPARE: u32 = 1 << 2;
    pub const DEALLOCATE: u32 = 1 << 3;
    pub const DISCARD: u32 = 1 << 4;
    pub const EXECUTE: u32 = 1 << 5;
    pub const SEARCH_PATH: u32 = 1 << 6;
    pub const PGMEMO_S: u32 = 1 << 7;
    // The session-state watch's (see `session::state`), DISCARD too.
    pub const SET: u32 = 1 << 8;
    pub const RESET: u32 = 1 << 9;
    pub const SET_CONFIG: u32 = 1 << 10;
    pub const LISTEN: u32 = 1 << 11;
    pub const UNLISTEN: u32 = 1 << 12;
    pub const TEMP: u32 = 1 << 13;
    pub const PG_TEMP: u32 = 1 << 14;
    pub const HOLD: u32 = 1 << 15;
    pub const LOAD: u32 = 1 << 16;
    pub const PG_ADVISORY: u32 = 1 << 17;
    pub const CLOSE: u32 = 1 << 18;
    pub const DROP: u32 = 1 << 19;
    // Schema changes, which prepared statements follow (see `statements::schema`); DROP too.
    pub const CREATE: u32 = 1 << 20;
    pub const ALTER: u32 = 1 << 21;
    // The session-state watch's again: `pg_try_advisory_lock*` does not start with
    // `pg_advisory`.
    pub const PG_TRY_ADVISORY: u32 = 1 << 22;
    pub const ALL: u32 = (1 << 23) - 1;

    pub const WORDS: WordSet<23> = WordSet::new([
        b"begin",
        b"start",
        b"prepare",
        b"deallocate",
        b"discard",
        b"execute",
        b"search_path",
        b"pgmemo_s",
        b"set",
        b"reset",
        b"set_config",
        b"listen",
        b"unlisten",
        b"temp",
        b"pg_temp",
        b"hold",
        b"load",
        b"pg_advisory",
        b"close",
        b"drop",
        b"create",
        b"alter",
        b"pg_try_advisory",
    ])
    .whole(DROP | CREATE | ALTER);
}

/// Which of [`query::WORDS`] a simple query's text contains.
pub fn in_query(text: &[u8]) -> u32 {
    query::WORDS.found_in(text, query::ALL)
}

#[cfg(test)]
mod tests {
    use super::WordSet;

    const SET: WordSet<3> = WordSet::new([b"begin", b"temp", b"pg_temp"]);

    #[test]
    fn prefixes_at_word_starts_in_any_case() {
        assert_eq!(SET.found_in(b"x; BEGIN", 0b111), 0b001);
        assert_eq!(SET.found_in(b"create TEMPORARY table", 0b111), 0b010);
        assert_eq!(SET.found_in(b"create table pg_temp.t", 0b111), 0b100);
        assert_eq!(SET.found_in(b"xbegin mytemp", 0b111), 0);
        assert_eq!(SET.found_in(b"(begin", 0b001), 0b001);
        assert_eq!(SET.found_in(b"begin temp", 0b010), 0b010);
        assert_eq!(SET.found_in(b"", 0b111), 0);
    }

    #[test]
    fn whole_words() {
        const DDL: WordSet<2> = WordSet::new([b"create", b"temp"]).whole(0b01);
        assert_eq!(DDL.found_in(b"SELECT created_at, create1", 0b11), 0);
        assert_eq!(DDL.found_in(b"CREATE\tTEMPORARY", 0b11), 0b11);
        assert_eq!(DDL.found_in(b"x;create", 0b11), 0b01);
        assert_eq!(DDL.found_in(b"create(", 0b11), 0b01);
    }
}
