//! A cheap, generous test for which of a few SQL words a text contains: run once on every
//! simple query ([`in_query`]), its answer shared by the statement planner and the
//! session-state watch, which then decide exactly what a query that contains one of their
//! words does.
//!
//! One pass over the text, eight bytes at a time, finds where identifiers start; the words are
//! compared only there, and only those that begin with that byte. A word matches as a
//! prefix, in any case: `temp` is found in `TEMPORARY` (and in `temperature`, which costs the
//! caller an exact check, never a wrong answer). Words marked whole ([`WordSet::whole`]) match
//! only as whole words: `create` is not found in `created_at`, a column of every other table.

/// Up to 31 words; word `i` is bit `1 << i` of the sets [`WordSet::found_in`] returns.
pub struct WordSet<const N: usize> {
    words: [&'static [u8]; N],
    /// Each word's first (up to) four bytes, ORed with 0x20 per byte: a text whose next four
    /// bytes, ORed likewise, differ cannot hold the word there (letters fold to lower case,
    /// other bytes stay or only gain the bit), so most candidates are rejected with one
    /// comparison before the exact one.
    prefix: [u32; N],
    /// The mask for each word's prefix (0xff per byte it has, up to four).
    prefix_mask: [u32; N],
    /// For each byte: the words that start with it (either case), and [`IDENTIFIER`] when it
    /// continues an identifier (a letter, `_`, a non-ASCII byte): no word starts right after
    /// such a byte.
    class: [u32; 256],
    /// For each byte ORed with 0x20: the words whose second (`second`) or third (`third`)
    /// byte, ORed likewise, it is. Where a word starts, both narrow the candidates that
    /// `class` gives before any comparison (every word has at least three bytes).
    second: [u32; 256],
    third: [u32; 256],
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
        let mut prefix = [0u32; N];
        let mut prefix_mask = [0u32; N];
        let mut second = [0u32; 256];
        let mut third = [0u32; 256];
        let mut i = 0;
        while i < N {
            let first = words[i][0];
            assert!(first.is_ascii_alphabetic(), "words start with a letter");
            assert!(words[i].len() >= 3, "words have at least three bytes");
            class[first as usize] |= 1 << i;
            class[first.to_ascii_uppercase() as usize] |= 1 << i;
            second[(words[i][1] | 0x20) as usize] |= 1 << i;
            third[(words[i][2] | 0x20) as usize] |= 1 << i;
            let mut j = 0;
            while j < 4 && j < words[i].len() {
                prefix[i] |= ((words[i][j] | 0x20) as u32) << (8 * j);
                prefix_mask[i] |= 0xff << (8 * j);
                j += 1;
            }
            i += 1;
        }
        WordSet {
            words,
            prefix,
            prefix_mask,
            class,
            second,
            third,
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
        // Eight bytes at a time: where identifier runs start (every word starts with a letter,
        // see `new`, so nothing else can start one), found with a few word-wide operations
        // instead of a branch per byte; each start is then looked up as one byte.
        let mut last_was_identifier = 0u64;
        let mut base = 0;
        while base < text.len() {
            // The tail is padded with NULs: not identifier bytes, so no run starts there.
            let chunk = u64::from_le_bytes(padded(&text[base..]));
            let identifier = identifier_bytes(chunk);
            let mut starts = identifier & !((identifier << 8) | last_was_identifier);
            last_was_identifier = identifier >> 56;
            while starts != 0 {
                let at = base + (starts.trailing_zeros() / 8) as usize;
                starts &= starts - 1;
                found |= self.starting_at(&text[at..], wanted & !found);
            }
            base += 8;
        }
        found
    }

    /// Which of the `wanted` words `rest` starts with (its first byte starts an identifier).
    #[inline(always)]
    fn starting_at(&self, rest: &[u8], wanted: u32) -> u32 {
        let mut candidates = self.class[rest[0] as usize] & wanted;
        if candidates == 0 {
            return 0;
        }
        // Past the end reads as NUL, which no word has.
        let next4 = u32::from_le_bytes(padded(rest)) | 0x2020_2020;
        candidates &=
            self.second[(next4 >> 8) as u8 as usize] & self.third[(next4 >> 16) as u8 as usize];
        let mut found = 0;
        // Only the words that start with this byte.
        while candidates != 0 {
            let i = candidates.trailing_zeros() as usize;
            candidates &= candidates - 1;
            let word = self.words[i];
            if next4 & self.prefix_mask[i] == self.prefix[i]
                && rest.len() >= word.len()
                && rest[..word.len()].eq_ignore_ascii_case(word)
                && (self.whole & (1 << i) == 0
                    || rest.get(word.len()).is_none_or(|&next| {
                        self.class[next as usize] & IDENTIFIER == 0 && !next.is_ascii_digit()
                    }))
            {
                found |= 1 << i;
            }
        }
        found
    }
}

/// The first `N` bytes of `bytes`, NULs past its end.
#[inline(always)]
fn padded<const N: usize>(bytes: &[u8]) -> [u8; N] {
    match bytes.first_chunk::<N>() {
        Some(b) => *b,
        None => {
            let mut b = [0u8; N];
            b[..bytes.len()].copy_from_slice(bytes);
            b
        }
    }
}

/// Bit 7 of each byte of `v` (eight text bytes, little-endian) set where that byte is an
/// identifier's (an ASCII letter, `_`, a non-ASCII byte: [`IDENTIFIER`] in the class table),
/// every other bit clear. No sum below carries into the next byte: each byte is at most 0x7f
/// before its addition and at most 0xfe after.
#[inline(always)]
fn identifier_bytes(v: u64) -> u64 {
    const EACH: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x80 * EACH;
    let low = v & !HIGH;
    // Letters fold to lower case; no other byte lands in a..z by setting 0x20.
    let folded = low | (0x20 * EACH);
    let at_least_a = folded + (0x80 - b'a' as u64) * EACH;
    let past_z = folded + (0x80 - b'z' as u64 - 1) * EACH;
    let letter = at_least_a & !past_z;
    // A byte is non-zero exactly when adding 0x7f sets its bit 7.
    let not_underscore = (low ^ (b'_' as u64 * EACH)) + 0x7f * EACH;
    (v | letter | !not_underscore) & HIGH
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
    // All three also gate the statements that need a database to themselves (see
    // `query::database`).
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
    use super::{identifier_bytes, WordSet, IDENTIFIER};

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

    /// The four-byte prefilter never hides a word: on random texts made of the words'
    /// letters in both cases, `_`, digits, blanks and bytes that differ from letters only by
    /// the 0x20 bit (`@`, `^`, DEL), the answer equals a plain scan's.
    #[test]
    fn the_prefilter_agrees_with_a_plain_scan() {
        let words = &super::query::WORDS;
        let plain = |text: &[u8]| -> u32 {
            let mut found = 0;
            for at in 0..text.len() {
                let starts = at == 0 || words.class[text[at - 1] as usize] & IDENTIFIER == 0;
                for (i, word) in words.words.iter().enumerate() {
                    let rest = &text[at..];
                    let whole = words.whole & (1 << i) == 0
                        || rest.get(word.len()).is_none_or(|&next| {
                            words.class[next as usize] & IDENTIFIER == 0 && !next.is_ascii_digit()
                        });
                    if starts
                        && rest.len() >= word.len()
                        && rest[..word.len()].eq_ignore_ascii_case(word)
                        && whole
                    {
                        found |= 1 << i;
                    }
                }
            }
            found
        };
        let alphabet = b"setSETbginBGINaprlcdoumhx_ _0@^\x7f;(ADVISORYadvisory";
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            let mut text = Vec::new();
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let len = (seed % 40) as usize;
            for _ in 0..len {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                text.push(alphabet[(seed % alphabet.len() as u64) as usize]);
            }
            // Every word somewhere now and then, in mixed case.
            if seed.is_multiple_of(3) {
                let w = words.words[(seed >> 8) as usize % words.words.len()];
                text.extend(w.iter().enumerate().map(|(i, &b)| {
                    if (seed >> (16 + i % 32)) & 1 == 1 {
                        b.to_ascii_uppercase()
                    } else {
                        b
                    }
                }));
            }
            assert_eq!(
                words.found_in(&text, super::query::ALL),
                plain(&text),
                "{:?}",
                String::from_utf8_lossy(&text)
            );
        }
    }

    /// The word-wide identifier test agrees with the class table for every byte in every
    /// lane, whatever its neighbours are (no carries between lanes).
    #[test]
    fn identifier_bytes_agree_with_the_class_table() {
        let class = &super::query::WORDS.class;
        for b in 0..=255u8 {
            for lane in 0..8 {
                for fill in [0u8, b'a', b'Z', b'_', b'0', 0x7f, 0xff] {
                    let mut bytes = [fill; 8];
                    bytes[lane] = b;
                    let got = identifier_bytes(u64::from_le_bytes(bytes));
                    for (i, &x) in bytes.iter().enumerate() {
                        assert_eq!(
                            got >> (8 * i + 7) & 1 == 1,
                            class[x as usize] & IDENTIFIER != 0,
                            "byte {x:#x} in lane {i} of {bytes:x?}"
                        );
                    }
                    assert_eq!(got & !0x8080_8080_8080_8080, 0);
                }
            }
        }
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
