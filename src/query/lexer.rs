//! One pass over a simple query's text that finds its literals, the hot path of autoprepare.
//!
//! The pass follows PostgreSQL 15's lexer (scan.l) for everything that decides where a token
//! starts and ends: whitespace, `--` and nested `/* */` comments, quoted identifiers (also
//! `U&"..."` with `UESCAPE`), strings (`'...'` with `''`, continuation across a newline, `E'...'`
//! with backslash escapes, `B'...'`, `X'...'`, `N'...'`, `U&'...'`), dollar quotes, numbers and
//! `$n` parameters. It yields the *generalized* text — comments dropped, every literal that can be
//! a parameter replaced by `$1..$n` in text order — a hash of that text with the literals' types,
//! and each literal's place and value.
//!
//! Whatever it does not understand it refuses ([`Refusal`]): the query then goes to the server
//! untouched and PostgreSQL answers it (or reports its syntax error) itself. Refused outright:
//! several statements, `$n` (a simple query cannot have parameters: PostgreSQL's own error),
//! unterminated quotes and comments, numbers glued to letters (`0x1F`, `1_000`, `123abc`: read
//! differently by PostgreSQL versions), and statements that are not a `SELECT`, `VALUES`,
//! `TABLE`, `WITH`, `INSERT`, `UPDATE`, `DELETE` or `MERGE`. Literals it understands but that
//! never become parameters stay in the text as they are ([`Kind::Verbatim`]): `U&'...'`, `N'...'`
//! (a typed literal) and `E'...'` with octal, hex or Unicode escapes (their bytes are checked by
//! the server against the encoding, with errors a parameter would not give).
//!
//! Nothing is allocated per token: the caller's [`Lexed`] keeps its buffers between queries.

use std::hash::BuildHasher;

/// How a literal is sent as a parameter: its type as PostgreSQL would type the literal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// An integer that fits in 32 bits.
    Int4,
    /// An integer that fits in 64 bits only.
    Int8,
    /// Any other number (a decimal point, an exponent, or too large for 64 bits).
    Numeric,
    /// A string constant: sent as type `unknown` (0), for the server to infer, as it infers the
    /// literal's.
    Text,
    /// `B'...'` / `X'...'`: type `bit`, the value as PostgreSQL's lexer makes it (`b101`, `x1F`).
    Bit,
    /// Understood, but never a parameter: stays in the text.
    Verbatim,
}

impl Kind {
    /// The type OID sent in the Parse for a parameter of this kind.
    pub fn type_oid(self) -> u32 {
        match self {
            Kind::Int4 => 23,
            Kind::Int8 => 20,
            Kind::Numeric => 1700,
            Kind::Bit => 1560,
            Kind::Text | Kind::Verbatim => 0,
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            Kind::Int4 => 1,
            Kind::Int8 => 2,
            Kind::Numeric => 3,
            Kind::Text => 4,
            Kind::Bit => 5,
            Kind::Verbatim => 6,
        }
    }
}

/// One literal of the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Literal {
    /// Where the token starts and ends in the original text (bytes; prefixes, quotes and a
    /// continuation included).
    pub start: u32,
    pub end: u32,
    /// Its position as PostgreSQL reports error positions: characters from the start, 1-based.
    pub position: u32,
    /// The position of the character after it.
    pub end_position: u32,
    pub kind: Kind,
    /// Where it is in the generalized text ([`Lexed::text`]): its `$n`, or itself.
    pub gen_start: u32,
    pub gen_end: u32,
    /// Its value, in [`Lexed::values`] (empty for [`Kind::Verbatim`]).
    value_start: u32,
    value_end: u32,
}

/// Why a text is not generalized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// Not a single SELECT / VALUES / TABLE / WITH / INSERT / UPDATE / DELETE / MERGE.
    NotDml,
    /// More than one statement.
    MultiStatement,
    /// The text uses `$n`.
    HasParameters,
    /// Something the lexer does not read the way PostgreSQL would be sure to: unterminated
    /// quotes or comments, a number glued to letters, a lone `$`.
    NotUnderstood,
    /// Over [`MAX_TEXT`] bytes or [`MAX_LITERALS`] literals (bulk loads: each row count
    /// would be a statement of its own, parsed on pgmemo's cold path and kept on servers).
    TooLarge,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::NotDml => "not a query or DML statement",
            Refusal::MultiStatement => "several statements",
            Refusal::HasParameters => "uses $n parameters",
            Refusal::NotUnderstood => "text not understood by the lexer",
            Refusal::TooLarge => "too large",
        }
    }
}

/// Larger texts, and texts with more literals, are sent as they are.
pub const MAX_TEXT: usize = 64 * 1024;
pub const MAX_LITERALS: usize = 4096;

/// The result of one pass, with buffers kept for the next one.
#[derive(Debug, Default)]
pub struct Lexed {
    /// The generalized text: comments dropped, parameter literals replaced by `$1..$n`.
    pub text: Vec<u8>,
    /// Every literal, in text order (parameters and verbatim ones).
    pub literals: Vec<Literal>,
    /// The decoded values of the parameter literals, back to back.
    values: Vec<u8>,
    /// Where comments were dropped: the offset in `text` after each, and the position (in
    /// the original) of the character that follows it.
    pub comments: Vec<(u32, u32)>,
    /// Where each comment is in the original text (bytes, from its `/*` or `--` to its end):
    /// the only places a hint may be ([`super::hint`]), never a string or a quoted name.
    pub comment_spans: Vec<(u32, u32)>,
    /// Hash of `text` and the parameters' kinds: the shape.
    pub shape: u64,
    /// How many literals became `$n`.
    pub params: usize,
}

impl Lexed {
    pub fn value(&self, literal: &Literal) -> &[u8] {
        &self.values[literal.value_start as usize..literal.value_end as usize]
    }

    /// The parameter literals, in `$n` order.
    pub fn parameters(&self) -> impl Iterator<Item = &Literal> {
        self.literals.iter().filter(|l| l.kind != Kind::Verbatim)
    }

    fn clear(&mut self) {
        self.text.clear();
        self.literals.clear();
        self.values.clear();
        self.comments.clear();
        self.comment_spans.clear();
        self.shape = 0;
        self.params = 0;
    }
}

/// A map hasher with a fixed seed, for keys that are hashes already.
pub type FixedHash = foldhash::fast::FixedState;

/// The hasher of shapes and statement texts: fixed seed, so hashes are the same in every
/// session (they are shown in SHOW AUTOPREPARE).
pub fn hasher() -> foldhash::fast::FixedState {
    foldhash::fast::FixedState::with_seed(0x7067_6d65_6d6f)
}

/// How many texts [`generalize`] has read, in debug builds (tests hold the session to one
/// reading per query: `tests/one_reading.rs`); nothing is counted in release builds.
#[cfg(debug_assertions)]
pub static PASSES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Reads `sql` (a simple query's text, without its terminating NUL) into `out`.
pub fn generalize(sql: &[u8], out: &mut Lexed) -> Result<(), Refusal> {
    #[cfg(debug_assertions)]
    PASSES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut lexer = Lexer::<false>::new(sql, out)?;
    lexer.run()?;
    let out = lexer.out;
    let mut h = hasher().build_hasher();
    std::hash::Hasher::write(&mut h, &out.text);
    for literal in out.literals.iter() {
        std::hash::Hasher::write_u8(&mut h, literal.kind.code());
    }
    out.shape = std::hash::Hasher::finish(&h);
    Ok(())
}

/// Whether [`reread`] can take `out`, a reading of `sql` by [`generalize`], for the next text:
/// `sql` is ASCII (a position is its byte offset plus one), has no comment, and every literal
/// is an integer of its digits alone that fits in 32 bits (`aid = 12345`, `LIMIT 10`).
pub fn rereadable(sql: &[u8], out: &Lexed) -> bool {
    out.comments.is_empty()
        && sql.is_ascii()
        && out.literals.iter().all(|l| {
            l.kind == Kind::Int4
                && sql[l.start as usize..l.end as usize]
                    .iter()
                    .all(u8::is_ascii_digit)
        })
}

/// Reads `sql` by the reading `out` holds of `prev` ([`rereadable`]): when `sql` is `prev` with
/// other digits in its integer literals (of 1 to 9 digits, so still int4), `out` becomes what
/// [`generalize`] makes of `sql` — the same generalized text and shape, the literals moved and
/// their values replaced — without the pass (a client mostly repeats a query with other
/// numbers: `pgbench -S`'s ~55 bytes cost ~820 instructions to lex, ~100 this way). False, and
/// `out` untouched, for anything else.
///
/// Why it is the lexer's reading: the bytes before each literal are `prev`'s, so every token
/// there reads the same and the literal starts a number as it did; the digits end where the
/// next bytes are `prev`'s after its literal, which ended that number (no digit, and no `.`,
/// `e` or letter that would continue it: the literal was an int4 of digits alone); and the
/// rest is `prev`'s to the end. The unit test checks the result against [`generalize`].
pub fn reread(sql: &[u8], prev: &[u8], out: &mut Lexed) -> bool {
    // First the check, touching nothing; then the literals moved. The digits of the first
    // literals are counted once, for both.
    const COUNTED: usize = 16;
    let mut counted = [0u8; COUNTED];
    let mut at = 0; // in sql
    let mut prev_at = 0;
    for (i, l) in out.literals.iter().enumerate() {
        let same = &prev[prev_at..l.start as usize];
        if sql.get(at..at + same.len()) != Some(same) {
            return false;
        }
        at += same.len();
        let digits = sql[at..].iter().take_while(|b| b.is_ascii_digit()).count();
        if !(1..=9).contains(&digits) {
            return false;
        }
        if let Some(c) = counted.get_mut(i) {
            *c = digits as u8;
        }
        at += digits;
        prev_at = l.end as usize;
    }
    if sql.get(at..) != prev.get(prev_at..) {
        return false;
    }
    #[cfg(debug_assertions)]
    PASSES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    out.values.clear();
    let mut shift: isize = 0; // sql's offsets minus prev's
    for (i, l) in out.literals.iter_mut().enumerate() {
        let start = (l.start as isize + shift) as usize;
        let digits = match counted.get(i) {
            Some(&c) => c as usize,
            None => sql[start..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count(),
        };
        let end = start + digits;
        shift += digits as isize - (l.end - l.start) as isize;
        let value_start = out.values.len() as u32;
        out.values.extend_from_slice(&sql[start..end]);
        *l = Literal {
            start: start as u32,
            end: end as u32,
            position: start as u32 + 1,
            end_position: end as u32 + 1,
            value_start,
            value_end: out.values.len() as u32,
            ..*l
        };
    }
    true
}

/// Reads the text of a statement of the extended protocol, which may use `$n`, for where its
/// comments are ([`Lexed::comment_spans`]): the same pass as [`generalize`], whose other
/// results (the text, the literals, the shape) mean nothing here. Run once per statement.
pub fn comments(sql: &[u8], out: &mut Lexed) -> Result<(), Refusal> {
    Lexer::<true>::new(sql, out)?.run()
}

/// `PARAMETERS`: `$n` is read as a token (a statement's text, see [`comments`]), not refused;
/// a parameter of the type, so that [`generalize`]'s pass has no test for it.
struct Lexer<'a, const PARAMETERS: bool> {
    sql: &'a [u8],
    at: usize,
    /// Characters in `sql[..chars_at]`, counted lazily for literal positions.
    chars: u32,
    chars_at: usize,
    /// `sql[..ascii]` is ASCII: a position there is its byte offset, with nothing to count
    /// (the whole text for most queries; 0 when it has other characters).
    ascii: usize,
    /// `sql[..copied]` is in `out.text` (as it is, or as placeholders and comment gaps): the
    /// text is copied a run at a time, when something that is not copied as it is comes.
    copied: usize,
    out: &'a mut Lexed,
}

/// What each byte can be, one table lookup instead of a chain of comparisons per byte.
const SPACE: u8 = 1;
const IDENT_START: u8 = 2;
const IDENT_CONT: u8 = 4;

const CLASS: [u8; 256] = {
    let mut class = [0u8; 256];
    let mut c = 0;
    while c < 256 {
        let b = c as u8;
        if matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'\x0c' | b'\x0b') {
            class[c] = SPACE;
        }
        if b.is_ascii_alphabetic() || b == b'_' || b >= 0x80 {
            class[c] = IDENT_START | IDENT_CONT;
        }
        if b.is_ascii_digit() || b == b'$' {
            class[c] = IDENT_CONT;
        }
        c += 1;
    }
    class
};

#[inline]
fn is_space(b: u8) -> bool {
    CLASS[b as usize] & SPACE != 0
}

#[inline]
fn is_ident_start(b: u8) -> bool {
    CLASS[b as usize] & IDENT_START != 0
}

#[inline]
fn is_ident_cont(b: u8) -> bool {
    CLASS[b as usize] & IDENT_CONT != 0
}

/// Statements whose first word makes them candidates. (Inlined: a call here, once
/// [`comments`] made the pass two, cost ~5 instructions a query, callgrind.)
#[inline(always)]
fn is_dml_word(word: &[u8]) -> bool {
    const WORDS: [&[u8]; 8] = [
        b"select", b"values", b"table", b"with", b"insert", b"update", b"delete", b"merge",
    ];
    WORDS.iter().any(|w| w.eq_ignore_ascii_case(word))
}

/// The bytes the body loop looks at: quotes (`'`, `"`), `$`, `-` and `/` (comments), `.` and
/// digits (numbers), `;`, and `#` (next to `"` and `$`, so one range test covers the three).
const INTERESTING: [bool; 256] = {
    let mut t = [false; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = matches!(
            c as u8,
            b'"' | b'#' | b'$' | b'\'' | b'-' | b'.' | b'/' | b'0'..=b'9' | b';'
        );
        c += 1;
    }
    t
};

/// Where the next [`INTERESTING`] byte is from `at` on (the length when there is none): in
/// most statements words, blanks and punctuation are most of the text, and this passes over
/// them sixteen bytes at a time.
#[inline]
fn next_interesting(sql: &[u8], mut at: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    while let Some(chunk) = sql.get(at..at + 16) {
        use std::arch::x86_64::*;
        // SAFETY: SSE2 is part of every x86_64 CPU, and the load reads the 16 bytes of
        // `chunk`. The comparisons are signed: bytes from 0x80 (non-ASCII) are below all.
        let mask = unsafe {
            let v = _mm_loadu_si128(chunk.as_ptr().cast());
            let between = |lo: i8, hi: i8| {
                _mm_and_si128(
                    _mm_cmpgt_epi8(v, _mm_set1_epi8(lo - 1)),
                    _mm_cmpgt_epi8(_mm_set1_epi8(hi + 1), v),
                )
            };
            let quote_etc = between(b'"' as i8, b'$' as i8);
            let minus_to_nine = between(b'-' as i8, b'9' as i8);
            let quote = _mm_cmpeq_epi8(v, _mm_set1_epi8(b'\'' as i8));
            let semicolon = _mm_cmpeq_epi8(v, _mm_set1_epi8(b';' as i8));
            let any = _mm_or_si128(
                _mm_or_si128(quote_etc, minus_to_nine),
                _mm_or_si128(quote, semicolon),
            );
            _mm_movemask_epi8(any) as u32
        };
        if mask != 0 {
            return at + mask.trailing_zeros() as usize;
        }
        at += 16;
    }
    while at < sql.len() && !INTERESTING[sql[at] as usize] {
        at += 1;
    }
    at
}

impl<'a, const PARAMETERS: bool> Lexer<'a, PARAMETERS> {
    /// A pass over `sql` into `out` (cleared), unless the text is too long to read.
    #[inline]
    fn new(sql: &'a [u8], out: &'a mut Lexed) -> Result<Self, Refusal> {
        out.clear();
        if sql.len() > MAX_TEXT {
            return Err(Refusal::TooLarge);
        }
        Ok(Lexer {
            sql,
            at: 0,
            chars: 0,
            chars_at: 0,
            ascii: if sql.is_ascii() { sql.len() } else { 0 },
            copied: 0,
            out,
        })
    }

    fn peek(&self, ahead: usize) -> u8 {
        self.sql.get(self.at + ahead).copied().unwrap_or(0)
    }

    /// Copies the text up to `to` as it is.
    fn copy_to(&mut self, to: usize) {
        self.out.text.extend_from_slice(&self.sql[self.copied..to]);
        self.copied = to;
    }

    fn position_of(&mut self, at: usize) -> u32 {
        if at <= self.ascii {
            self.chars = at as u32;
            self.chars_at = at;
            return at as u32 + 1;
        }
        for &b in &self.sql[self.chars_at..at] {
            if b & 0xC0 != 0x80 {
                self.chars += 1;
            }
        }
        self.chars_at = at;
        self.chars + 1
    }

    /// Three phases, so that the loop over the statement's body tests no flags per byte:
    /// up to the first word (which must be a DML word, maybe after parentheses), the body up
    /// to a `;`, and after it nothing but blanks and comments.
    fn run(&mut self) -> Result<(), Refusal> {
        loop {
            match self.blanks()? {
                Some(b'(') => self.at += 1,
                Some(b) if is_ident_start(b) => break,
                _ => return Err(Refusal::NotDml),
            }
        }
        let start = self.at;
        while self.at < self.sql.len() && is_ident_cont(self.sql[self.at]) {
            self.at += 1;
        }
        // A string's prefix (`E'..'`, `U&'..'`) reads as a word of one letter here: never a
        // DML word either.
        if !is_dml_word(&self.sql[start..self.at]) {
            return Err(Refusal::NotDml);
        }
        // The body, a jump at a time to the next byte that may start a token other than a
        // word or an operator (see `next_interesting`): words, blanks and punctuation are
        // copied as they are. `token_end` is where the last token looked at ended.
        let mut token_end = self.at;
        loop {
            self.at = next_interesting(self.sql, self.at);
            let Some(&b) = self.sql.get(self.at) else {
                break;
            };
            // A digit or `$` right after a word's byte continues that word (`t1`, `a$b`): its
            // first byte was a letter, `_` or a non-ASCII byte, which the jump passes over,
            // since a digit or `$` that starts a token is a token of its own, looked at here.
            let in_word = self.at > token_end && is_ident_cont(self.sql[self.at - 1]);
            match b {
                b'0'..=b'9' | b'$' if in_word => {
                    while self.at < self.sql.len() && is_ident_cont(self.sql[self.at]) {
                        self.at += 1;
                    }
                }
                b'\'' | b'"' => self.quoted(token_end)?,
                b'$' => self.dollar()?,
                b'0'..=b'9' => self.number()?,
                b'.' if self.peek(1) == b'.' => self.at += 2, // `..` is a token: `..5` has 5
                b'.' if self.peek(1).is_ascii_digit() => self.number()?,
                b'-' if self.peek(1) == b'-' => self.line_comment(),
                b'/' if self.peek(1) == b'*' => self.block_comment()?,
                b';' => {
                    self.at += 1;
                    if self.blanks()?.is_some() {
                        return Err(Refusal::MultiStatement);
                    }
                }
                _ => self.at += 1,
            }
            token_end = self.at;
        }
        self.copy_to(self.sql.len());
        Ok(())
    }

    /// Skips blanks and comments: the byte that follows them, or None at the end.
    fn blanks(&mut self) -> Result<Option<u8>, Refusal> {
        while self.at < self.sql.len() {
            let b = self.sql[self.at];
            if is_space(b) {
                self.at += 1;
            } else if b == b'-' && self.peek(1) == b'-' {
                self.line_comment();
            } else if b == b'/' && self.peek(1) == b'*' {
                self.block_comment()?;
            } else {
                return Ok(Some(b));
            }
        }
        Ok(None)
    }

    /// Where a comment was (from `start` to here), a space keeps the tokens on either side
    /// apart.
    fn comment_gap(&mut self, start: usize) {
        self.copy_to(start);
        if self.out.text.last().is_some_and(|&b| !is_space(b)) {
            self.out.text.push(b' ');
        }
        self.copied = self.at;
        let after = self.position_of(self.at);
        self.out.comments.push((self.out.text.len() as u32, after));
        self.out.comment_spans.push((start as u32, self.at as u32));
    }

    fn line_comment(&mut self) {
        let start = self.at;
        while self.at < self.sql.len() && !matches!(self.sql[self.at], b'\n' | b'\r') {
            self.at += 1;
        }
        self.comment_gap(start);
    }

    fn block_comment(&mut self) -> Result<(), Refusal> {
        let start = self.at;
        let mut depth = 0usize;
        while self.at < self.sql.len() {
            if self.peek(0) == b'/' && self.peek(1) == b'*' {
                depth += 1;
                self.at += 2;
            } else if self.peek(0) == b'*' && self.peek(1) == b'/' {
                depth -= 1;
                self.at += 2;
                if depth == 0 {
                    self.comment_gap(start);
                    return Ok(());
                }
            } else {
                // On to the next `*` or `/`, the only bytes that may begin `/*` or `*/` (a
                // byte at a time cost ~10 instructions a byte: a hint comment's ~250).
                self.at += 1;
                self.at += memchr::memchr2(b'*', b'/', &self.sql[self.at..])
                    .unwrap_or(self.sql.len() - self.at);
            }
        }
        Err(Refusal::NotUnderstood)
    }

    /// A quote in the statement's body: a string, with the prefix glued to it if any
    /// (`E'..'`, `B'..'`, `X'..'`, `N'..'`, `U&'..'`), or a quoted identifier (`"..."`,
    /// `U&"..."`). A prefix is a word of one letter: it starts at `token_end` (where the last
    /// token looked at ended) or after a byte no word has; `ab'x'` is the word `ab` and a
    /// string, as `word` reads them at the start.
    fn quoted(&mut self, token_end: usize) -> Result<(), Refusal> {
        let at = self.at;
        let sql = self.sql;
        let letter_before = |end: usize| {
            (end > token_end && (end - 1 == token_end || !is_ident_cont(sql[end - 2])))
                .then(|| sql[end - 1])
        };
        if at >= 2 && sql[at - 1] == b'&' && matches!(letter_before(at - 1), Some(b'u' | b'U')) {
            return self.unicode_escaped(at - 2);
        }
        if sql[at] == b'"' {
            return self.quoted_identifier();
        }
        let kind = match letter_before(at) {
            Some(b'e' | b'E') => StrKind::Escape,
            Some(b'b' | b'B') => StrKind::Bit(b'b'),
            Some(b'x' | b'X') => StrKind::Bit(b'x'),
            Some(b'n' | b'N') => StrKind::National,
            _ => return self.string(at, at, StrKind::Plain),
        };
        self.string(at - 1, at, kind)
    }

    fn quoted_identifier(&mut self) -> Result<(), Refusal> {
        self.at = closing_quote(self.sql, self.at + 1, b'"').ok_or(Refusal::NotUnderstood)?;
        Ok(())
    }

    /// `U&'...'` or `U&"..."`, with an optional `UESCAPE 'c'`: kept as it is.
    fn unicode_escaped(&mut self, start: usize) -> Result<(), Refusal> {
        let quote = self.sql[start + 2];
        let mut end = closing_quote(self.sql, start + 3, quote).ok_or(Refusal::NotUnderstood)?;
        // A string may continue on the next line, before its UESCAPE.
        if quote == b'\'' {
            while let Some(next) = continuation(self.sql, end) {
                end = closing_quote(self.sql, next + 1, b'\'').ok_or(Refusal::NotUnderstood)?;
            }
        }
        let mut after = end;
        while after < self.sql.len() && is_space(self.sql[after]) {
            after += 1;
        }
        let rest = &self.sql[after..];
        if rest.len() >= 7 && rest[..7].eq_ignore_ascii_case(b"uescape") {
            let mut q = after + 7;
            while q < self.sql.len() && is_space(self.sql[q]) {
                q += 1;
            }
            if self.sql.get(q) != Some(&b'\'') {
                return Err(Refusal::NotUnderstood);
            }
            end = closing_quote(self.sql, q + 1, b'\'').ok_or(Refusal::NotUnderstood)?;
        }
        self.at = end;
        if quote == b'"' {
            return Ok(());
        }
        self.verbatim(start, end);
        Ok(())
    }

    /// A string literal starting at `start` whose opening quote is at `quote`.
    fn string(&mut self, start: usize, quote: usize, kind: StrKind) -> Result<(), Refusal> {
        let value_start = self.out.values.len();
        if let StrKind::Bit(prefix) = kind {
            self.out.values.push(prefix);
        }
        let mut plain = true; // no escape a parameter would read differently
        let mut open = quote;
        let end = loop {
            let close = match kind {
                StrKind::Escape => self.escape_body(open + 1, &mut plain)?,
                // No `''` in a bit string: `b'1''0'` is two constants (and an error).
                StrKind::Bit(_) => {
                    let close = open
                        + 2
                        + self.sql[open + 1..]
                            .iter()
                            .position(|&b| b == b'\'')
                            .ok_or(Refusal::NotUnderstood)?;
                    self.out
                        .values
                        .extend_from_slice(&self.sql[open + 1..close - 1]);
                    close
                }
                _ => {
                    let close =
                        closing_quote(self.sql, open + 1, b'\'').ok_or(Refusal::NotUnderstood)?;
                    unquote(&self.sql[open + 1..close - 1], &mut self.out.values);
                    close
                }
            };
            match continuation(self.sql, close) {
                Some(next) => open = next,
                None => break close,
            }
        };
        self.at = end;
        let kind = match kind {
            StrKind::National => Kind::Verbatim,
            StrKind::Escape if !plain => Kind::Verbatim,
            StrKind::Bit(_) => Kind::Bit,
            _ => Kind::Text,
        };
        if kind == Kind::Verbatim {
            self.out.values.truncate(value_start);
            self.verbatim(start, end);
            return Ok(());
        }
        self.parameter(start, end, kind, value_start)
    }

    /// The body of an `E'...'` part from `from`, decoded into the values; returns the index
    /// after its closing quote. `plain` is cleared by escapes that make raw bytes.
    fn escape_body(&mut self, from: usize, plain: &mut bool) -> Result<usize, Refusal> {
        let mut i = from;
        loop {
            let &b = self.sql.get(i).ok_or(Refusal::NotUnderstood)?;
            match b {
                b'\'' if self.sql.get(i + 1) == Some(&b'\'') => {
                    self.out.values.push(b'\'');
                    i += 2;
                }
                b'\'' => return Ok(i + 1),
                b'\\' => {
                    let &c = self.sql.get(i + 1).ok_or(Refusal::NotUnderstood)?;
                    let decoded = match c {
                        b'b' => 8,
                        b'f' => 12,
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'0'..=b'7' | b'x' | b'u' | b'U' => {
                            *plain = false;
                            c
                        }
                        _ => c,
                    };
                    self.out.values.push(decoded);
                    i += 2;
                }
                _ => {
                    self.out.values.push(b);
                    i += 1;
                }
            }
        }
    }

    /// `$tag$...$tag$` or `$n`.
    fn dollar(&mut self) -> Result<(), Refusal> {
        if self.peek(1).is_ascii_digit() {
            if !PARAMETERS {
                return Err(Refusal::HasParameters);
            }
            self.at += 1;
            while self.peek(0).is_ascii_digit() {
                self.at += 1;
            }
            return Ok(());
        }
        let start = self.at;
        let mut tag_end = start + 1;
        if self.sql.get(tag_end).is_some_and(|&b| is_ident_start(b)) {
            while self
                .sql
                .get(tag_end)
                .is_some_and(|&b| is_ident_start(b) || b.is_ascii_digit())
            {
                tag_end += 1;
            }
        }
        if self.sql.get(tag_end) != Some(&b'$') {
            return Err(Refusal::NotUnderstood);
        }
        let tag = &self.sql[start..=tag_end];
        let body = tag_end + 1;
        let close = find(&self.sql[body..], tag).ok_or(Refusal::NotUnderstood)? + body;
        let end = close + tag.len();
        let value_start = self.out.values.len();
        self.out.values.extend_from_slice(&self.sql[body..close]);
        self.at = end;
        self.parameter(start, end, Kind::Text, value_start)
    }

    fn number(&mut self) -> Result<(), Refusal> {
        let sql = self.sql;
        let start = self.at;
        let mut i = start;
        while i < sql.len() && sql[i].is_ascii_digit() {
            i += 1;
        }
        let mut integer = true;
        if sql.get(i) == Some(&b'.') && sql.get(i + 1) != Some(&b'.') {
            integer = false;
            i += 1;
            while i < sql.len() && sql[i].is_ascii_digit() {
                i += 1;
            }
        }
        if matches!(sql.get(i), Some(b'e' | b'E')) {
            let mut j = i + 1;
            if matches!(sql.get(j), Some(b'+' | b'-')) {
                j += 1;
            }
            if !sql.get(j).is_some_and(u8::is_ascii_digit) {
                return Err(Refusal::NotUnderstood); // "trailing junk" in PostgreSQL 15
            }
            while j < sql.len() && sql[j].is_ascii_digit() {
                j += 1;
            }
            integer = false;
            i = j;
        }
        if sql.get(i).is_some_and(|&b| is_ident_start(b)) {
            return Err(Refusal::NotUnderstood); // 0x1F, 1_000, 123abc
        }
        let digits = &sql[start..i];
        let kind = if integer {
            integer_kind(digits)
        } else {
            Kind::Numeric
        };
        let value_start = self.out.values.len();
        self.out.values.extend_from_slice(digits);
        self.at = i;
        self.parameter(start, i, kind, value_start)
    }

    /// A literal kept in the text as it is.
    fn verbatim(&mut self, start: usize, end: usize) {
        let position = self.position_of(start);
        let end_position = self.position_of(end);
        let at = self.out.values.len() as u32;
        self.copy_to(start);
        let gen_start = self.out.text.len() as u32;
        self.copy_to(end);
        self.out.literals.push(Literal {
            start: start as u32,
            end: end as u32,
            position,
            end_position,
            kind: Kind::Verbatim,
            gen_start,
            gen_end: self.out.text.len() as u32,
            value_start: at,
            value_end: at,
        });
    }

    /// A literal that becomes `$n` in the generalized text.
    #[inline(always)]
    fn parameter(
        &mut self,
        start: usize,
        end: usize,
        kind: Kind,
        value_start: usize,
    ) -> Result<(), Refusal> {
        if self.out.params == MAX_LITERALS {
            return Err(Refusal::TooLarge);
        }
        let position = self.position_of(start);
        let end_position = self.position_of(end);
        self.out.params += 1;
        self.copy_to(start);
        let gen_start = self.out.text.len() as u32;
        let gen_end = push_placeholder(
            &mut self.out.text,
            self.out.params,
            self.sql.get(end).copied(),
        );
        self.copied = end;
        self.out.literals.push(Literal {
            start: start as u32,
            end: end as u32,
            position,
            end_position,
            kind,
            gen_start,
            gen_end: gen_end as u32,
            value_start: value_start as u32,
            value_end: self.out.values.len() as u32,
        });
        Ok(())
    }
}

/// Appends `$n`, with a space on either side where it would otherwise run into a word
/// (`SELECT'a'` → `SELECT $1`, `'a'AND` → `$1 AND`). Returns where its digits end.
#[inline(always)]
pub fn push_placeholder(text: &mut Vec<u8>, n: usize, next: Option<u8>) -> usize {
    if text.last().is_some_and(|&b| is_ident_cont(b)) {
        text.push(b' ');
    }
    text.push(b'$');
    if n < 10 {
        text.push(b'0' + n as u8); // most statements have fewer than ten literals
    } else {
        let mut digits = [0u8; 8];
        let mut len = 0;
        let mut v = n;
        while v != 0 {
            digits[len] = b'0' + (v % 10) as u8;
            len += 1;
            v /= 10;
        }
        text.extend(digits[..len].iter().rev());
    }
    let end = text.len();
    if next.is_some_and(is_ident_cont) {
        text.push(b' ');
    }
    end
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StrKind {
    Plain,
    Escape,
    /// `B` or `X`, as the value's first byte.
    Bit(u8),
    National,
}

/// The type PostgreSQL gives a number with its minus folded in by the grammar (`-digits`):
/// int4 if the negative value fits, else int8, else numeric (so `-2147483648` is an int4 and
/// `-9223372036854775808` an int8, though neither number fits without its sign).
pub fn negative_kind(number: &[u8]) -> Kind {
    if !number.iter().all(u8::is_ascii_digit) {
        return Kind::Numeric;
    }
    let mut v: u128 = 0;
    for &d in number {
        v = v.saturating_mul(10).saturating_add(u128::from(d - b'0'));
    }
    if v <= 1 << 31 {
        Kind::Int4
    } else if v <= 1 << 63 {
        Kind::Int8
    } else {
        Kind::Numeric
    }
}

/// The type PostgreSQL gives an integer literal: int4 if it fits, else int8, else numeric.
fn integer_kind(digits: &[u8]) -> Kind {
    if digits.len() <= 9 {
        return Kind::Int4; // at most 999,999,999: most integers, no arithmetic
    }
    let mut v: u64 = 0;
    for &d in digits {
        match v
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(d - b'0')))
        {
            Some(n) => v = n,
            None => return Kind::Numeric,
        }
    }
    if v <= i32::MAX as u64 {
        Kind::Int4
    } else if v <= i64::MAX as u64 {
        Kind::Int8
    } else {
        Kind::Numeric
    }
}

/// The index after the quote that closes a quoted token whose body starts at `from`
/// (a doubled quote stands for one).
fn closing_quote(sql: &[u8], from: usize, quote: u8) -> Option<usize> {
    let mut i = from;
    loop {
        let at = i + sql.get(i..)?.iter().position(|&b| b == quote)?;
        if sql.get(at + 1) == Some(&quote) {
            i = at + 2;
        } else {
            return Some(at + 1);
        }
    }
}

/// The body of a `'...'` string, `''` read as `'`.
fn unquote(body: &[u8], out: &mut Vec<u8>) {
    let mut i = 0;
    while i < body.len() {
        out.push(body[i]);
        i += if body[i] == b'\'' { 2 } else { 1 };
    }
}

/// If the string that ended before `end` continues (whitespace with a newline, `--` comments
/// allowed, then a quote), where the next part's quote is.
fn continuation(sql: &[u8], end: usize) -> Option<usize> {
    let mut i = end;
    let mut newline = false;
    while i < sql.len() {
        match sql[i] {
            b'\n' | b'\r' => {
                newline = true;
                i += 1;
            }
            b if is_space(b) => i += 1,
            b'-' if sql.get(i + 1) == Some(&b'-') => {
                while i < sql.len() && !matches!(sql[i], b'\n' | b'\r') {
                    i += 1;
                }
            }
            b'\'' if newline => return Some(i),
            _ => return None,
        }
    }
    None
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// For tests of the lexer (its unit tests, tests/fuzz.rs): `out`'s generalized text of `sql`
/// with each parameter literal's original token back in place of its `$n`, and an empty
/// comment where each comment was (dropped, two strings around one could read as one
/// continued string: `'a' /* */\n'b'`). It must read as the same shape with the same values.
#[doc(hidden)]
pub fn rebuild(sql: &[u8], out: &Lexed) -> Vec<u8> {
    let mut commented = Vec::new();
    let mut shift = Vec::new(); // (offset in text, bytes inserted before it)
    let mut from = 0;
    for &(at, _) in &out.comments {
        commented.extend_from_slice(&out.text[from..at as usize]);
        commented.extend_from_slice(b"/**/");
        from = at as usize;
        shift.push((at as usize, commented.len() - from));
    }
    commented.extend_from_slice(&out.text[from..]);
    let moved = |offset: u32| {
        let offset = offset as usize;
        offset
            + shift
                .iter()
                .rev()
                .find(|&&(at, _)| at <= offset)
                .map_or(0, |&(_, by)| by)
    };
    let mut rebuilt = Vec::new();
    let mut at = 0;
    for l in &out.literals {
        rebuilt.extend_from_slice(&commented[at..moved(l.gen_start)]);
        if rebuilt.last().is_some_and(|&b| is_ident_cont(b)) {
            rebuilt.push(b' ');
        }
        rebuilt.extend_from_slice(&sql[l.start as usize..l.end as usize]);
        at = moved(l.gen_end);
    }
    rebuilt.extend_from_slice(&commented[at..]);
    rebuilt
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sixteen-byte jump stops exactly where the byte table says, for every byte in every
    /// lane (signed comparisons: no byte from 0x80 counts), and so does the byte loop after it.
    #[test]
    fn the_jump_stops_at_interesting_bytes_only() {
        for b in 0..=255u8 {
            let interesting = matches!(
                b,
                b'"' | b'#' | b'$' | b'\'' | b'-' | b'.' | b'/' | b'0'..=b'9' | b';'
            );
            assert_eq!(INTERESTING[b as usize], interesting, "{b:#x}");
            for len in [16, 21, 40] {
                for lane in 0..len {
                    let mut text = vec![b'a'; len];
                    text[lane] = b;
                    let expected = if interesting { lane } else { len };
                    assert_eq!(
                        next_interesting(&text, 0),
                        expected,
                        "{b:#x} at {lane} of {len}"
                    );
                    assert_eq!(
                        next_interesting(&text, lane.min(3)),
                        expected.max(lane.min(3))
                    );
                }
            }
        }
    }

    #[test]
    fn byte_classes_are_postgresql_s() {
        for b in 0..=255u8 {
            let space = matches!(b, b' ' | b'\t' | b'\n' | b'\r' | b'\x0c' | b'\x0b');
            let start = b.is_ascii_alphabetic() || b == b'_' || b >= 0x80;
            let cont = start || b.is_ascii_digit() || b == b'$';
            assert_eq!(is_space(b), space, "{b}");
            assert_eq!(is_ident_start(b), start, "{b}");
            assert_eq!(is_ident_cont(b), cont, "{b}");
        }
    }

    fn gen(sql: &str) -> Result<(String, Vec<(Kind, String)>), Refusal> {
        let mut out = Lexed::default();
        generalize(sql.as_bytes(), &mut out)?;
        let values = out
            .literals
            .iter()
            .map(|l| {
                let v = if l.kind == Kind::Verbatim {
                    &sql.as_bytes()[l.start as usize..l.end as usize]
                } else {
                    out.value(l)
                };
                (l.kind, String::from_utf8_lossy(v).into_owned())
            })
            .collect();
        Ok((String::from_utf8(out.text.clone()).unwrap(), values))
    }

    fn text(sql: &str) -> String {
        gen(sql).unwrap().0
    }

    #[test]
    fn numbers_get_postgresql_types() {
        let (t, v) = gen("SELECT 1, 3000000000, 99999999999999999999, 1.5, .5, 1e3, 2.").unwrap();
        assert_eq!(t, "SELECT $1, $2, $3, $4, $5, $6, $7");
        let kinds: Vec<Kind> = v.iter().map(|(k, _)| *k).collect();
        use Kind::*;
        assert_eq!(
            kinds,
            [Int4, Int8, Numeric, Numeric, Numeric, Numeric, Numeric]
        );
        assert_eq!(v[1].1, "3000000000");
        assert_eq!(
            gen("SELECT 2147483647, 2147483648").unwrap().1[1].0,
            Kind::Int8
        );
    }

    #[test]
    fn numbers_glued_to_letters_are_refused() {
        for q in [
            "SELECT 0x1F",
            "SELECT 1_000",
            "SELECT 123abc",
            "SELECT 1e",
            "SELECT 0o17",
        ] {
            assert_eq!(gen(q), Err(Refusal::NotUnderstood), "{q}");
        }
        // `1..2` is an integer followed by `..`.
        assert_eq!(text("SELECT a[1:2] FROM t"), "SELECT a[$1:$2] FROM t");
    }

    #[test]
    fn strings_and_their_forms() {
        let (t, v) =
            gen("SELECT 'it''s', E'a\\nb\\'c', $$x'y$$, $q$ $$ $q$, B'101', X'1F'").unwrap();
        assert_eq!(t, "SELECT $1, $2, $3, $4, $5, $6");
        assert_eq!(v[0].1, "it's");
        assert_eq!(v[1].1, "a\nb'c");
        assert_eq!(v[2].1, "x'y");
        assert_eq!(v[3].1, " $$ ");
        assert_eq!(v[4], (Kind::Bit, "b101".into()));
        assert_eq!(v[5], (Kind::Bit, "x1F".into()));
        // Raw bytes from escapes, national and Unicode strings stay in the text.
        let (t, v) =
            gen("SELECT E'\\101', N'x', U&'d\\0061t', U&'d!0061t' UESCAPE '!', 'z'").unwrap();
        assert_eq!(
            t,
            "SELECT E'\\101', N'x', U&'d\\0061t', U&'d!0061t' UESCAPE '!', $1"
        );
        assert_eq!(v.len(), 5);
        assert_eq!(v[4], (Kind::Text, "z".into()));
    }

    #[test]
    fn string_continuation_needs_a_newline() {
        let (t, v) = gen("SELECT 'foo'\n  'bar', 'x'").unwrap();
        assert_eq!(t, "SELECT $1, $2");
        assert_eq!(v[0].1, "foobar");
        let (t, v) = gen("SELECT 'a' -- note\n'b'").unwrap();
        assert_eq!(t, "SELECT $1");
        assert_eq!(v[0].1, "ab");
        // Without a newline two strings are two tokens (a syntax error for the server).
        assert_eq!(text("SELECT 'a' 'b'"), "SELECT $1 $2");
    }

    #[test]
    fn comments_are_not_part_of_the_shape() {
        assert_eq!(
            text("SELECT /* a /* nested */ b */ 1 -- tail"),
            "SELECT  $1 "
        );
        assert_eq!(text("SELECT/**/1"), "SELECT $1");
        let mut a = Lexed::default();
        let mut b = Lexed::default();
        generalize(b"SELECT 1 /* request=1 */", &mut a).unwrap();
        generalize(b"SELECT 2 /* request=2 */", &mut b).unwrap();
        assert_eq!(a.shape, b.shape);
    }

    /// Each comment's place in the original text, for hints: leading, inside, after the
    /// `;`, a `--` comment up to its line's end; none inside a string or a quoted name.
    #[test]
    fn comment_spans_are_where_the_comments_are() {
        let sql = "/* a */ SELECT '/* s */' AS \"/*q*/\", 1 -- b\n FROM t /* c /* d */ */; -- e";
        let mut out = Lexed::default();
        generalize(sql.as_bytes(), &mut out).unwrap();
        let found: Vec<&str> = out
            .comment_spans
            .iter()
            .map(|&(start, end)| &sql[start as usize..end as usize])
            .collect();
        assert_eq!(found, ["/* a */", "-- b", "/* c /* d */ */", "-- e"]);
        // A statement's text with `$n` is read for its comments.
        let sql = "SELECT $1, a$2 FROM t WHERE x = $12 /* h */";
        assert_eq!(gen(sql), Err(Refusal::HasParameters));
        comments(sql.as_bytes(), &mut out).unwrap();
        assert_eq!(out.comment_spans, [(36, 43)]);
    }

    #[test]
    fn identifiers_and_words_are_left_alone() {
        assert_eq!(
            text("SELECT \"a\"\"b'\", a$1, t.col1 FROM \"T\" WHERE x='y'AND z=1"),
            "SELECT \"a\"\"b'\", a$1, t.col1 FROM \"T\" WHERE x=$1 AND z=$2"
        );
        assert_eq!(
            text("SELECT U&\"d!0061t\" UESCAPE '!' FROM t"),
            "SELECT U&\"d!0061t\" UESCAPE '!' FROM t"
        );
        assert_eq!(text("SELECT'a'"), "SELECT $1");
    }

    #[test]
    fn refusals() {
        assert_eq!(gen("SELECT 1; SELECT 2"), Err(Refusal::MultiStatement));
        assert_eq!(text("SELECT 1;"), "SELECT $1;");
        assert_eq!(gen("SELECT $1"), Err(Refusal::HasParameters));
        assert_eq!(gen("SET x = 1"), Err(Refusal::NotDml));
        assert_eq!(gen("BEGIN"), Err(Refusal::NotDml));
        assert_eq!(gen(""), Err(Refusal::NotDml));
        assert_eq!(gen("  -- nothing\n"), Err(Refusal::NotDml));
        assert_eq!(gen("SELECT 'open"), Err(Refusal::NotUnderstood));
        assert_eq!(gen("SELECT /* open"), Err(Refusal::NotUnderstood));
        assert_eq!(gen("SELECT $a"), Err(Refusal::NotUnderstood));
        assert_eq!(text("(SELECT 1)"), "(SELECT $1)");
        assert_eq!(
            text("with x as (select 1) select * from x"),
            "with x as (select $1) select * from x"
        );
    }

    #[test]
    fn large_texts_are_sent_as_they_are() {
        let many = format!("VALUES ({})", vec!["1"; MAX_LITERALS + 1].join("),("));
        assert_eq!(gen(&many), Err(Refusal::TooLarge));
        let long = format!("SELECT '{}'", "x".repeat(MAX_TEXT));
        assert_eq!(gen(&long), Err(Refusal::TooLarge));
        assert!(gen(&format!("VALUES ({})", vec!["1"; 100].join("),("))).is_ok());
    }

    #[test]
    fn positions_count_characters() {
        let mut out = Lexed::default();
        generalize("SELECT 'é', 'x'".as_bytes(), &mut out).unwrap();
        let p: Vec<u32> = out.literals.iter().map(|l| l.position).collect();
        assert_eq!(p, [8, 13]);
    }

    /// Checks one text: the pass never panics; when it generalizes, the literals are in
    /// order inside the text, and putting each parameter literal's original token back in
    /// place of its `$n` gives a text that reads as the same shape with the same values.
    fn check_roundtrip(sql: &[u8]) {
        let mut out = Lexed::default();
        if generalize(sql, &mut out).is_err() {
            return;
        }
        let mut end = 0;
        for l in &out.literals {
            assert!(l.start as usize >= end && l.start < l.end && l.end as usize <= sql.len());
            end = l.end as usize;
        }
        check_against_postgresql(sql, &out);
        let rebuilt = rebuild(sql, &out);
        let mut again = Lexed::default();
        generalize(&rebuilt, &mut again).unwrap_or_else(|e| {
            panic!(
                "{:?} rebuilt as {:?} is refused: {e:?}",
                String::from_utf8_lossy(sql),
                String::from_utf8_lossy(&rebuilt)
            )
        });
        let values = |x: &Lexed| -> Vec<(Kind, Vec<u8>)> {
            x.literals
                .iter()
                .map(|l| (l.kind, x.value(l).to_vec()))
                .collect()
        };
        assert_eq!(
            (again.shape, values(&again)),
            (out.shape, values(&out)),
            "{:?} rebuilt as {:?}",
            String::from_utf8_lossy(sql),
            String::from_utf8_lossy(&rebuilt)
        );
    }

    /// The literals of a text the pass generalizes are exactly the constants PostgreSQL's
    /// own scanner (pg_query's) finds there, where they start and end. pg_query scans as
    /// PostgreSQL 18 does, which reads some numbers PostgreSQL 15 rejects (`0x1F`, `1_000`):
    /// the pass refuses those. Left out: texts with `UESCAPE` (one literal here, three tokens
    /// there). `N'..'` is a keyword and a string there: its string starts after the `N`.
    fn check_against_postgresql(sql: &[u8], out: &Lexed) {
        use pg_query::protobuf::Token;
        let Ok(text) = std::str::from_utf8(sql) else {
            return;
        };
        if text.to_ascii_lowercase().contains("uescape") {
            return;
        }
        let Ok(tokens) = pg_query::scan_tokens(text) else {
            return;
        };
        let constants: Vec<(usize, usize)> = tokens
            .iter()
            .filter(|t| {
                [
                    Token::Iconst,
                    Token::Fconst,
                    Token::Sconst,
                    Token::Usconst,
                    Token::Bconst,
                    Token::Xconst,
                ]
                .iter()
                .any(|&k| t.token == k as i32)
            })
            .map(|t| (t.start as usize, t.end as usize))
            .collect();
        let ours: Vec<(usize, usize)> = out
            .literals
            .iter()
            .map(|l| {
                let national = matches!(sql[l.start as usize], b'n' | b'N');
                (l.start as usize + usize::from(national), l.end as usize)
            })
            .collect();
        assert_eq!(ours, constants, "{text:?}");
        COMPARED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Texts [`check_against_postgresql`] compared.
    static COMPARED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    #[test]
    fn fuzz_random_text_and_mutations() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
        // Bytes that matter to the lexer, weighted towards SQL.
        const ALPHABET: &[u8] =
            b"SELECT selectfrom wherEUuBbXxNn&'\"$$__--//**..0123456789eE+-;:()[],=<> \n\t\r\xc3\xa9\xff\\";
        let seeds = [
            "SELECT * FROM t WHERE a = 1 AND b = 'x''y' AND c IN (1.5, 2e3) LIMIT 10",
            "SELECT E'a\\nb', $q$x$q$, B'101', X'1F', U&'d!0061t' UESCAPE '!' FROM t",
            "INSERT INTO t VALUES (1, 'a'\n 'b', -2147483648, .5) RETURNING *",
            "SELECT /* c /* d */ */ 1 -- x\n, \"q\"\"i\", a$1 FROM t",
            "WITH x AS (SELECT 'é') UPDATE t SET a = 3 FROM x WHERE b = $$z$$",
        ];
        for _ in 0..20_000 {
            let len = rng.gen_range(0..60);
            let text: Vec<u8> = (0..len)
                .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())])
                .collect();
            check_roundtrip(&text);
            let mut text = seeds[rng.gen_range(0..seeds.len())].as_bytes().to_vec();
            for _ in 0..rng.gen_range(1..4) {
                let at = rng.gen_range(0..=text.len());
                match rng.gen_range(0..3) {
                    0 => text.insert(at, ALPHABET[rng.gen_range(0..ALPHABET.len())]),
                    1 if at < text.len() => {
                        text.remove(at);
                    }
                    _ if at < text.len() => text[at] = ALPHABET[rng.gen_range(0..ALPHABET.len())],
                    _ => {}
                }
            }
            check_roundtrip(&text);
        }
        for seed in seeds {
            check_roundtrip(seed.as_bytes());
        }
    }

    /// Texts made of the pieces where the pass could read a token differently from
    /// PostgreSQL (prefixes next to quotes and words, digits and `$` inside and after words,
    /// dots, comments, continuations), glued in any order after a DML word: every one the
    /// pass generalizes has PostgreSQL's constants (see [`check_against_postgresql`]).
    #[test]
    fn literals_are_postgresql_s_constants() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x11735);
        const PIECES: &[&str] = &[
            " ",
            "\n",
            "a",
            "b1",
            "t2x",
            "e",
            "E",
            "x",
            "X",
            "n",
            "N",
            "b",
            "B",
            "u",
            "U",
            "&",
            "_",
            "é",
            "'s'",
            "''",
            "'it''s'",
            "'a'\n'b'",
            "\"q\"",
            "\"a\"\"b\"",
            "1",
            "42",
            "3.5",
            ".5",
            "1e3",
            "1.",
            "..",
            ".",
            "$$d$$",
            "$t$x$t$",
            "$",
            "a$b",
            "-",
            "--c\n",
            "/*c*/",
            "/* /* */ */",
            ",",
            "(",
            ")",
            "=",
            "+",
            "#",
            "E'a\\'b'",
            "E'\\x41'",
            "B'101'",
            "X'1F'",
        ];
        let before = COMPARED.load(std::sync::atomic::Ordering::Relaxed);
        for _ in 0..20_000 {
            let mut text = String::from(["SELECT ", "select(", "VALUES ("][rng.gen_range(0..3)]);
            for _ in 0..rng.gen_range(1..10) {
                text.push_str(PIECES[rng.gen_range(0..PIECES.len())]);
            }
            check_roundtrip(text.as_bytes());
        }
        let compared = COMPARED.load(std::sync::atomic::Ordering::Relaxed) - before;
        assert!(compared > 5_000, "only {compared} texts were compared");
    }

    #[test]
    fn a_reread_of_many_literals_is_the_lexer_s_reading() {
        // More literals than `reread` counts the digits of once: the rest counted again.
        let text = |digits: &dyn Fn(usize) -> String| {
            let values: Vec<String> = (0..20).map(digits).collect();
            format!("SELECT * FROM t WHERE id IN ({})", values.join(", "))
        };
        let prev = text(&|i| (i + 1).to_string());
        let sql = text(&|i| (1000 * i + 7).to_string());
        let mut out = Lexed::default();
        generalize(prev.as_bytes(), &mut out).unwrap();
        assert!(rereadable(prev.as_bytes(), &out));
        assert!(reread(sql.as_bytes(), prev.as_bytes(), &mut out));
        let mut fresh = Lexed::default();
        generalize(sql.as_bytes(), &mut fresh).unwrap();
        assert_eq!(format!("{out:?}"), format!("{fresh:?}"));
    }

    /// [`reread`] makes exactly [`generalize`]'s reading of a text, or declines: texts of
    /// words, operators, dots, quotes and integers (the pieces where a number could read
    /// otherwise: `1.5`, `1e3`, `1..2`, `a1`, `$1`), read once, then again with other digits
    /// (1 to 11 of them, so some no longer int4) and with a byte changed, inserted or removed.
    #[test]
    fn a_reread_is_the_lexer_s_reading() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x4e4ead);
        const PIECES: &[&str] = &[
            " ",
            "\n",
            "a",
            "b1",
            "x",
            "e",
            "E",
            "_",
            "1",
            "42",
            "7",
            "2147483647",
            "3.5",
            ".",
            "..",
            "e3",
            "'s'",
            "\"q\"",
            "$",
            "$$d$$",
            "-",
            "+",
            ",",
            "(",
            ")",
            "=",
            ";",
            "é",
            "--c\n",
            "/*c*/",
        ];
        const BYTES: &[u8] = b"0123456789.eE_a $';-/(";
        let (mut reread_ok, mut declined) = (0, 0);
        for _ in 0..20_000 {
            let mut prev = String::from(["SELECT ", "select(", "VALUES ("][rng.gen_range(0..3)]);
            for _ in 0..rng.gen_range(1..8) {
                prev.push_str(PIECES[rng.gen_range(0..PIECES.len())]);
            }
            let prev = prev.into_bytes();
            let mut out = Lexed::default();
            if generalize(&prev, &mut out).is_err() || !rereadable(&prev, &out) {
                continue;
            }
            // Other digits in each literal, then maybe a byte changed anywhere.
            let mut sql = Vec::new();
            let mut at = 0;
            for l in &out.literals {
                sql.extend_from_slice(&prev[at..l.start as usize]);
                for _ in 0..rng.gen_range(1..12) {
                    sql.push(b'0' + rng.gen_range(0..10));
                }
                at = l.end as usize;
            }
            sql.extend_from_slice(&prev[at..]);
            if rng.gen_bool(0.5) {
                let at = rng.gen_range(0..=sql.len());
                let b = BYTES[rng.gen_range(0..BYTES.len())];
                match rng.gen_range(0..3) {
                    0 => sql.insert(at, b),
                    1 if at < sql.len() => {
                        sql.remove(at);
                    }
                    _ if at < sql.len() => sql[at] = b,
                    _ => {}
                }
            }
            let mut fresh = Lexed::default();
            let generalized = generalize(&sql, &mut fresh);
            let before = format!("{out:?}");
            if reread(&sql, &prev, &mut out) {
                reread_ok += 1;
                assert_eq!(generalized, Ok(()), "{:?}", String::from_utf8_lossy(&sql));
                assert_eq!(
                    format!("{out:?}"),
                    format!("{fresh:?}"),
                    "{:?} after {:?}",
                    String::from_utf8_lossy(&sql),
                    String::from_utf8_lossy(&prev)
                );
            } else {
                declined += 1;
                assert_eq!(format!("{out:?}"), before, "declined, but changed");
            }
        }
        assert!(
            reread_ok > 2_000 && declined > 2_000,
            "{reread_ok} reread, {declined} declined"
        );
        // The one pgbench -S sends, and what is not reread.
        let mut out = Lexed::default();
        let prev = b"SELECT abalance FROM pgbench_accounts WHERE aid = 12345;";
        generalize(prev, &mut out).unwrap();
        assert!(rereadable(prev, &out));
        assert!(reread(
            b"SELECT abalance FROM pgbench_accounts WHERE aid = 7;",
            prev,
            &mut out
        ));
        let prev = b"SELECT abalance FROM pgbench_accounts WHERE aid = 7;";
        for other in [
            "SELECT abalance FROM pgbench_accounts WHERE aid = 7.5;",
            "SELECT abalance FROM pgbench_accounts WHERE aid = 7e1;",
            "SELECT abalance FROM pgbench_accounts WHERE aid = 1234567890;",
            "SELECT abalance FROM pgbench_accounts WHERE aid = 7a;",
            "SELECT abalance FROM pgbench_accounts WHERE aid = '7';",
            "SELECT abalance FROM pgbench_accounts WHERE aid = 7; ",
            "SELECT abalance FROM pgbench_accounts WHERE aid = ;",
            "SELECT abalance FROM pgbench_accounts WHERE aid = 7",
        ] {
            assert!(!reread(other.as_bytes(), prev, &mut out), "{other}");
        }
        for not_rereadable in [
            "SELECT 1.5",
            "SELECT 'a'",
            "SELECT 1 /* c */",
            "SELECT 'é', 1",
        ] {
            let mut out = Lexed::default();
            generalize(not_rereadable.as_bytes(), &mut out).unwrap();
            assert!(
                !rereadable(not_rereadable.as_bytes(), &out),
                "{not_rereadable}"
            );
        }
    }

    #[test]
    fn placeholders_beyond_nine() {
        let sql = format!("VALUES ({})", ["1"; 12].join(","));
        assert_eq!(
            text(&sql),
            "VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12)"
        );
    }
}
