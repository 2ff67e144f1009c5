//! The machinery behind the settings tables (`settings.rs` for `[general]`, `cache.rs` for
//! `[cache]`): what kinds of value a setting may hold, how the file may write them, and the
//! `settings!` macro that turns one line per setting into everything else.
//!
//! PgBouncer keeps its settings in one array, `bouncer_params[]` in `main.c`: one row per
//! setting with its name, type, variable, reload class and default, and SHOW CONFIG prints
//! that array. `settings!` is the same idea with Rust's types: one entry gives the name, the
//! type, the default, the bounds, whether RELOAD changes it, and its documentation; the macro
//! writes the section's struct (`General`, `CacheConfig`), its `Default`, the serde struct the
//! file is read into, the reading of each value with its key in hand, the bounds checks, the
//! SHOW CONFIG rows and the reference. A new setting is one entry.
//!
//! How a value is written in the file, read and shown depends on its Rust type ([`Value`]),
//! unless the entry names another [`Form`] (a unit, or more spellings); what is allowed
//! beyond that is the entry's `check`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;

/// The longest duration any setting or hint accepts (one year), so that deadlines computed
/// from a setting can never overflow a clock.
pub const MAX_DURATION_SECS: u64 = 31_536_000;

/// What a RELOAD (or SIGHUP) does to a setting: PgBouncer's reload class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reload {
    /// Applies to new connections and new checkouts after a RELOAD.
    Live,
    /// Read once at start; a changed value waits for a restart.
    Restart,
}

/// A setting that needs a restart, changed in the file that a RELOAD read: the running
/// value is kept (and SHOW CONFIG goes on showing it) until pgmemo restarts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRestart {
    /// The dotted key, `general.listen`.
    pub key: String,
    /// The value in effect, as SHOW CONFIG shows it.
    pub running: String,
    /// The value the file gives, waiting for a restart.
    pub pending: String,
}

/// One setting as the reference documents it: generated from the table.
#[derive(Debug, Clone, PartialEq)]
pub struct SettingDoc {
    /// The key under its section, as the file writes it.
    pub name: &'static str,
    /// What the file writes, as the reference says it (`seconds`, `"text" or "json"`).
    pub kind: &'static str,
    /// The default as SHOW CONFIG prints it ("" for none).
    pub default: String,
    pub reload: Reload,
    /// The doc comment of the entry, one paragraph.
    pub doc: String,
}

/// What reading a value needs besides the value: relative paths start at the config file's
/// directory.
pub(super) struct Context<'a> {
    pub base_dir: Option<&'a Path>,
}

/// A type a setting may have: how the file writes it, how it is read and shown.
pub trait Value: Sized {
    /// The value as TOML gives it, wider than the setting (an `i64` for a `u32`) so that a
    /// wrong value is judged with its key in hand rather than by serde.
    type Raw: DeserializeOwned;

    /// What the file writes, as the reference (docs/configuration.md) says it.
    const KIND: &'static str;

    /// The setting from what the file says, or what is wrong with it.
    fn read(raw: Self::Raw, cx: &Context<'_>) -> Result<Self, String>;

    /// The value as SHOW CONFIG prints it.
    fn show(&self) -> String;

    /// What every setting of this type must satisfy, however it was set (file or flag).
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

/// The bounds of a `u32` setting, as its messages say them.
pub(super) const U32_RANGE: &str = "a whole number 0..=4294967295";

impl Value for u32 {
    type Raw = i64;
    const KIND: &'static str = "integer";
    fn read(raw: i64, _: &Context<'_>) -> Result<u32, String> {
        u32::try_from(raw).map_err(|_| format!("must be {U32_RANGE}"))
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Value for usize {
    type Raw = i64;
    const KIND: &'static str = "integer";
    fn read(raw: i64, _: &Context<'_>) -> Result<usize, String> {
        usize::try_from(raw).map_err(|_| format!("must be a whole number 0..={}", usize::MAX))
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Value for f64 {
    type Raw = f64;
    const KIND: &'static str = "number";
    fn read(raw: f64, _: &Context<'_>) -> Result<f64, String> {
        Ok(raw)
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Value for bool {
    type Raw = bool;
    const KIND: &'static str = "boolean";
    fn read(raw: bool, _: &Context<'_>) -> Result<bool, String> {
        Ok(raw)
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Value for String {
    type Raw = String;
    const KIND: &'static str = "string";
    fn read(raw: String, _: &Context<'_>) -> Result<String, String> {
        Ok(raw)
    }
    fn show(&self) -> String {
        self.clone()
    }
}

/// Optional text (`metrics_listen`): unset is none, shown as "".
impl Value for Option<String> {
    type Raw = String;
    const KIND: &'static str = "string, optional";
    fn read(raw: String, _: &Context<'_>) -> Result<Option<String>, String> {
        Ok(Some(raw))
    }
    fn show(&self) -> String {
        self.clone().unwrap_or_default()
    }
}

/// A list of names (`admin_users`), shown comma-separated.
impl Value for Vec<String> {
    type Raw = Vec<String>;
    const KIND: &'static str = "list of strings";
    fn read(raw: Vec<String>, _: &Context<'_>) -> Result<Vec<String>, String> {
        Ok(raw)
    }
    fn show(&self) -> String {
        self.join(",")
    }
}

/// A file; a relative path is relative to the config file's directory.
impl Value for Option<PathBuf> {
    type Raw = PathBuf;
    const KIND: &'static str = "file path, optional";
    fn read(raw: PathBuf, cx: &Context<'_>) -> Result<Option<PathBuf>, String> {
        // "" is no file (PgBouncer's empty unix_socket_dir, "no socket"), not the config's
        // directory.
        if raw.as_os_str().is_empty() {
            return Ok(None);
        }
        Ok(Some(match cx.base_dir {
            Some(dir) if raw.is_relative() && !dir.as_os_str().is_empty() => dir.join(raw),
            _ => raw,
        }))
    }
    fn show(&self) -> String {
        self.as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    }
}

/// A duration, written as a number of seconds (`120`, `0.5`) and shown so.
impl Value for Duration {
    type Raw = Seconds;
    const KIND: &'static str = "seconds";
    fn read(Seconds(s): Seconds, _: &Context<'_>) -> Result<Duration, String> {
        if !s.is_finite() || s < 0.0 {
            return Err("must be a number of seconds, 0 or more".into());
        }
        if s > MAX_DURATION_SECS as f64 {
            return Err(format!(
                "must be at most {MAX_DURATION_SECS} seconds (one year)"
            ));
        }
        Ok(Duration::from_secs_f64(s))
    }
    fn show(&self) -> String {
        self.as_secs_f64().to_string()
    }
    fn check(&self) -> Result<(), String> {
        if self.as_secs_f64() > MAX_DURATION_SECS as f64 {
            return Err(format!(
                "must be at most {MAX_DURATION_SECS} seconds (one year)"
            ));
        }
        Ok(())
    }
}

/// A duration written as a number of seconds, integer or fractional (`120`, `0.5`).
pub struct Seconds(f64);

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Seconds;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a number of seconds, like 120 or 0.5")
            }
            fn visit_i64<E>(self, v: i64) -> Result<Seconds, E> {
                Ok(Seconds(v as f64))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Seconds, E> {
                Ok(Seconds(v as f64))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Seconds, E> {
                Ok(Seconds(v))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// An optional duration (`cache.max_lag`): unset is none, shown as "".
impl Value for Option<Duration> {
    type Raw = Seconds;
    const KIND: &'static str = "seconds, optional";
    fn read(raw: Seconds, cx: &Context<'_>) -> Result<Option<Duration>, String> {
        Duration::read(raw, cx).map(Some)
    }
    fn show(&self) -> String {
        self.as_ref().map(Value::show).unwrap_or_default()
    }
    fn check(&self) -> Result<(), String> {
        self.as_ref().map_or(Ok(()), Value::check)
    }
}

/// How the file writes a setting of type `T`. By default a type's own way ([`Own`]: its
/// [`Value`]); an entry's `as FORM` names another, for a key that holds the value in another
/// unit (`cache.max_memory_mb` for a size in bytes) or accepts more spellings (`[cache]`'s
/// durations also take text, `"5s"`).
pub trait Form<T> {
    /// The value as TOML gives it.
    type Raw: DeserializeOwned;
    /// What the file writes, as the reference says it.
    const KIND: &'static str;
    /// The setting from what the file says, or what is wrong with it.
    fn read(raw: Self::Raw, cx: &Context<'_>) -> Result<T, String>;
    /// The value as the file would write it.
    fn show(value: &T) -> String;
}

/// A type's own form: its [`Value`].
pub struct Own;

impl<T: Value> Form<T> for Own {
    type Raw = T::Raw;
    const KIND: &'static str = T::KIND;
    fn read(raw: T::Raw, cx: &Context<'_>) -> Result<T, String> {
        T::read(raw, cx)
    }
    fn show(value: &T) -> String {
        value.show()
    }
}

/// A duration as a number of seconds or as text with a unit (`"500ms"`, `"5s"`, `"2m"`,
/// `"1h"`, see [`parse_duration`]), at most a year: `[cache]`'s durations and its rules'
/// `ttl`, which hints write the same way.
pub struct TextOrSeconds;

/// What [`TextOrSeconds`] reads.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum RawDuration {
    Seconds(f64),
    Text(String),
}

impl Form<Duration> for TextOrSeconds {
    type Raw = RawDuration;
    const KIND: &'static str = "duration (seconds, or \"500ms\", \"5s\", \"2m\", \"1h\")";
    fn read(raw: RawDuration, _: &Context<'_>) -> Result<Duration, String> {
        let d = match raw {
            RawDuration::Seconds(s) if (0.0..=MAX_DURATION_SECS as f64).contains(&s) => {
                Some(Duration::from_secs_f64(s))
            }
            RawDuration::Seconds(_) => None,
            RawDuration::Text(t) => parse_duration(&t),
        };
        d.ok_or_else(|| {
            "must be a duration: seconds, or a number with ms, s, m or h (\"5s\")".into()
        })
    }
    fn show(value: &Duration) -> String {
        value.show()
    }
}

/// An optional duration written as [`TextOrSeconds`]: unset is none.
impl Form<Option<Duration>> for TextOrSeconds {
    type Raw = RawDuration;
    const KIND: &'static str = "duration, optional";
    fn read(raw: RawDuration, cx: &Context<'_>) -> Result<Option<Duration>, String> {
        <TextOrSeconds as Form<Duration>>::read(raw, cx).map(Some)
    }
    fn show(value: &Option<Duration>) -> String {
        value.show()
    }
}

/// `500ms`, `5s`, `5`, `2m`, `1h` (as hints and the config write them); at most a year.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: f64 = number.parse().ok()?;
    let scale = match unit.trim() {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        _ => return None,
    };
    let secs = n * scale;
    (secs.is_finite() && (0.0..=MAX_DURATION_SECS as f64).contains(&secs))
        .then(|| Duration::from_secs_f64(secs))
}

/// A size in bytes written in MiB, integer or fractional, above 0 and at most 1 TiB
/// (`cache.max_memory_mb`).
pub struct Mebibytes;

const MIB: f64 = 1024.0 * 1024.0;

impl Form<usize> for Mebibytes {
    type Raw = f64;
    const KIND: &'static str = "MiB (fractions allowed)";
    fn read(mb: f64, _: &Context<'_>) -> Result<usize, String> {
        if mb.is_finite() && mb > 0.0 && mb <= MIB {
            Ok((mb * MIB) as usize)
        } else {
            Err("must be a number of MiB above 0".into())
        }
    }
    fn show(value: &usize) -> String {
        (*value as f64 / MIB).to_string()
    }
}

/// A size in bytes, above 0 (`cache.max_result_bytes`, a rule's `max_result_bytes`).
pub struct Bytes;

impl Form<usize> for Bytes {
    type Raw = i64;
    const KIND: &'static str = "bytes";
    fn read(n: i64, _: &Context<'_>) -> Result<usize, String> {
        match usize::try_from(n) {
            Ok(n) if n > 0 => Ok(n),
            _ => Err("must be a number of bytes above 0".into()),
        }
    }
    fn show(value: &usize) -> String {
        value.to_string()
    }
}

/// Reads one value the file gives under `key` (a dotted key, `cache.rules[0].ttl`) in form
/// `F`; None when the file gives none. What is wrong is said against the key, with `range`
/// (the message's bounds) in place of the form's own message when given; the key's line is
/// found afterwards from the key (`ConfigError::at_line_of_key`). Every table entry and
/// `[[cache.rules]]` are read through here.
pub(super) fn read_key<T, F: Form<T>>(
    key: &str,
    raw: Option<F::Raw>,
    range: Option<&str>,
    cx: &Context<'_>,
) -> Result<Option<T>, super::ConfigError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    F::read(raw, cx)
        .map(Some)
        .map_err(|m| match range {
            Some(range) => format!("must be {range}"),
            None => m,
        })
        .map_err(|m| super::ConfigError::invalid(key, m))
}

/// `Ok` when `ok`, else the message: the shape of most `check`s.
pub(super) fn ensure(ok: bool, message: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(message())
    }
}

/// A settings table: one entry per scalar setting of a section, after a header that names the
/// section, the struct and its raw form, and the lists of tables in it:
///
/// ```text
/// /// Doc comment of the struct.
/// [SECTION] Struct from RawStruct [, checked on reading]
///     [, lists { /// doc
///                NAME: Vec<T> = read_fn(Vec<RawT>), ... }];
/// /// Doc comment: the reference line, and the field's documentation.
/// name: Type = default, Live | Restart [, key = "file_key"] [, as Form]
///     [, range = "..."] [, unset = fn(&Struct) -> Type]
///     [, check = fn(&Type, &Struct) -> Result<(), String>];
/// ```
///
/// - `key`: the key in the file when it is not the field's name (`max_memory_mb`);
/// - `as`: how the file writes the value ([`Form`]) when not as the type's own [`Value`];
/// - `range`: the message's bounds when the file's number does not fit the type at all (a
///   negative size), in place of the type's own;
/// - `unset`: the default when the file does not set the key, computed from the other
///   settings (`client_tls` is `allow` once a certificate and key are given). The plain
///   default is still what `Struct::default()` holds;
/// - `check`: what the value must satisfy, with the other settings at hand. The message is
///   read after the key (`general.NAME: must be ...`). `Struct::check` runs every check
///   (`[general]`'s, after the command-line flags); with `checked on reading` each value
///   the file gives is also checked as soon as it is read (`[cache]`, as it always was);
/// - `lists`: fields that are lists of tables (`[[cache.rules]]`), read by hand-written
///   `read_fn(raw, &struct_so_far, cx) -> Result<Vec<T>, ConfigError>` once every scalar is
///   read.
///
/// The order of the entries is the order of SHOW CONFIG, of the checks and of the keys an
/// unknown-key error lists.
macro_rules! settings {
    // An entry's `unset`, as an Option (internal).
    (@unset $s:ident $ty:ty) => { None::<fn(&$s) -> $ty> };
    (@unset $s:ident $ty:ty, $unset:expr) => { Some::<fn(&$s) -> $ty>($unset) };
    // An entry's form, key in the file, range, and whether its section checks on reading.
    (@form) => { $crate::config::table::Own };
    (@form $form:ty) => { $form };
    (@key $name:ident) => { stringify!($name) };
    (@key $name:ident $key:literal) => { $key };
    (@range) => { None::<&str> };
    (@range $range:expr) => { Some::<&str>($range) };
    (@on_read) => { false };
    (@on_read $reading:ident) => { true };

    (
        $(#[doc = $sdoc:literal])*
        [$section:ident] $Struct:ident from $Raw:ident
            $(, checked on $reading:ident)?
            $(, lists { $(
                $(#[doc = $ldoc:literal])*
                $list:ident: $lty:ty = $lread:ident($lraw:ty)
            ),* $(,)? })?
        ;
        $(
            $(#[doc = $doc:literal])*
            $name:ident: $ty:ty = $default:expr, $reload:ident
                $(, key = $key:literal)?
                $(, as $form:ty)?
                $(, range = $range:expr)?
                $(, unset = $unset:expr)?
                $(, check = $check:expr)?
            ;
        )*
    ) => {
        $(#[doc = $sdoc])*
        #[derive(Debug, Clone, PartialEq)]
        pub struct $Struct {
            $(
                $(#[doc = $doc])*
                pub $name: $ty,
            )*
            $($(
                $(#[doc = $ldoc])*
                pub $list: $lty,
            )*)?
        }

        impl Default for $Struct {
            fn default() -> Self {
                $Struct {
                    $($name: $default,)*
                    $($($list: Default::default(),)*)?
                }
            }
        }

        /// The section as written in the file: every key optional and wide, so that each
        /// value is judged with its key name in hand.
        #[derive(serde::Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        pub(super) struct $Raw {
            $(
                $(#[serde(rename = $key)])?
                $name: Option<
                    <settings!(@form $($form)?) as $crate::config::table::Form<$ty>>::Raw
                >,
            )*
            $($(
                #[serde(default)]
                $list: $lraw,
            )*)?
        }

        impl $Raw {
            /// The settings the file gives, each read and judged on its own; the rest at
            /// their defaults.
            pub(super) fn into_settings(
                self,
                cx: &$crate::config::table::Context<'_>,
            ) -> Result<$Struct, $crate::config::ConfigError> {
                use $crate::config::table::{read_key, Value};
                let on_read = settings!(@on_read $($reading)?);
                let mut s = $Struct::default();
                $(
                    let key = concat!(stringify!($section), ".", settings!(@key $name $($key)?));
                    let $name = match read_key::<$ty, settings!(@form $($form)?)>(
                        key,
                        self.$name,
                        settings!(@range $($range)?),
                        cx,
                    )? {
                        None => true,
                        Some(value) => {
                            s.$name = value;
                            if on_read {
                                let invalid = |m| $crate::config::ConfigError::invalid(key, m);
                                s.$name.check().map_err(invalid)?;
                                $(
                                    let check: fn(&$ty, &$Struct) -> Result<(), String> =
                                        $check;
                                    check(&s.$name, &s).map_err(invalid)?;
                                )?
                            }
                            false
                        }
                    };
                )*
                $(
                    if let (true, Some(unset)) =
                        ($name, settings!(@unset $Struct $ty $(, $unset)?))
                    {
                        s.$name = unset(&s);
                    }
                )*
                $($(
                    s.$list = $lread(self.$list, &s, cx)?;
                )*)?
                Ok(s)
            }
        }

        impl $Struct {
            /// Every setting's bounds, in table order: run on the final values, after the
            /// command-line flags.
            pub fn check(&self) -> Result<(), $crate::config::ConfigError> {
                use $crate::config::table::Value;
                $(
                    let key = concat!(stringify!($section), ".", settings!(@key $name $($key)?));
                    let invalid = |m| $crate::config::ConfigError::invalid(key, m);
                    self.$name.check().map_err(invalid)?;
                    $(
                        let check: fn(&$ty, &$Struct) -> Result<(), String> = $check;
                        check(&self.$name, self).map_err(invalid)?;
                    )?
                )*
                Ok(())
            }

            /// What a RELOAD cannot change: every `Restart` setting whose value here differs
            /// from `running`'s gets `running`'s back, and is returned with both values.
            pub fn keep_running(
                &mut self,
                running: &$Struct,
            ) -> Vec<$crate::config::table::PendingRestart> {
                use $crate::config::table::{Form, PendingRestart, Reload};
                let mut pending = Vec::new();
                $(
                    if Reload::$reload == Reload::Restart && self.$name != running.$name {
                        type F = settings!(@form $($form)?);
                        pending.push(PendingRestart {
                            key: concat!(
                                stringify!($section), ".", settings!(@key $name $($key)?)
                            ).to_string(),
                            running: <F as Form<$ty>>::show(&running.$name),
                            pending: <F as Form<$ty>>::show(&self.$name),
                        });
                        self.$name = running.$name.clone();
                    }
                )*
                pending
            }

            /// Takes the setting named `key` (as the file writes it) from `other`; false
            /// when the section has no such setting.
            pub fn take_key(&mut self, other: &$Struct, key: &str) -> bool {
                $(
                    if key == settings!(@key $name $($key)?) {
                        self.$name = other.$name.clone();
                        return true;
                    }
                )*
                false
            }

            /// SHOW CONFIG's rows for the section: (key, value, default, changeable by
            /// RELOAD).
            pub fn rows(&self) -> Vec<(&'static str, String, String, bool)> {
                use $crate::config::table::{Form, Reload};
                let d = $Struct::default();
                vec![$({
                    type F = settings!(@form $($form)?);
                    let default = match settings!(@unset $Struct $ty $(, $unset)?) {
                        Some(unset) => <F as Form<$ty>>::show(&unset(self)),
                        None => <F as Form<$ty>>::show(&d.$name),
                    };
                    (
                        settings!(@key $name $($key)?),
                        <F as Form<$ty>>::show(&self.$name),
                        default,
                        Reload::$reload == Reload::Live,
                    )
                },)*]
            }

            /// The reference of every setting, in table order.
            pub fn reference() -> Vec<$crate::config::table::SettingDoc> {
                use $crate::config::table::{Form, Reload, SettingDoc};
                let d = $Struct::default();
                vec![$(SettingDoc {
                    name: settings!(@key $name $($key)?),
                    kind: <settings!(@form $($form)?) as Form<$ty>>::KIND,
                    default: <settings!(@form $($form)?) as Form<$ty>>::show(&d.$name),
                    reload: Reload::$reload,
                    doc: [$($doc),*].map(str::trim).join(" "),
                },)*]
            }
        }
    };
}
pub(super) use settings;
