//! The machinery behind the settings table (`settings.rs`): what kinds of value a setting may
//! hold, and the `settings!` macro that turns one line per setting into everything else.
//!
//! PgBouncer keeps its settings in one array, `bouncer_params[]` in `main.c`: one row per
//! setting with its name, type, variable, reload class and default, and SHOW CONFIG prints
//! that array. `settings!` is the same idea with Rust's types: one entry gives the name, the
//! type, the default, the bounds, whether RELOAD changes it, and its documentation; the macro
//! writes the `General` struct, its `Default`, the serde struct the file is read into, the
//! reading of each value with its key in hand, the bounds checks, the SHOW CONFIG rows and
//! the reference. A new setting is one entry.
//!
//! How a value is written in the file, read and shown depends only on its Rust type
//! ([`Value`]); what is allowed beyond that is the entry's `check`.

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

/// One setting as the reference documents it: generated from the table.
#[derive(Debug, Clone, PartialEq)]
pub struct SettingDoc {
    /// The key under `[general]`.
    pub name: &'static str,
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
    fn read(raw: i64, _: &Context<'_>) -> Result<u32, String> {
        u32::try_from(raw).map_err(|_| format!("must be {U32_RANGE}"))
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Value for usize {
    type Raw = i64;
    fn read(raw: i64, _: &Context<'_>) -> Result<usize, String> {
        usize::try_from(raw).map_err(|_| format!("must be a whole number 0..={}", usize::MAX))
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Value for f64 {
    type Raw = f64;
    fn read(raw: f64, _: &Context<'_>) -> Result<f64, String> {
        Ok(raw)
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Value for bool {
    type Raw = bool;
    fn read(raw: bool, _: &Context<'_>) -> Result<bool, String> {
        Ok(raw)
    }
    fn show(&self) -> String {
        self.to_string()
    }
}

impl Value for String {
    type Raw = String;
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
    fn read(raw: PathBuf, cx: &Context<'_>) -> Result<Option<PathBuf>, String> {
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

/// The settings table: one entry per `[general]` setting:
///
/// ```text
/// /// Doc comment: the reference line, and the field's documentation.
/// name: Type = default, Live | Restart [, range = "..."] [, unset = fn(&General) -> Type]
///     [, check = fn(&Type, &General) -> Result<(), String>];
/// ```
///
/// - `range`: the message's bounds when the file's number does not fit the type at all (a
///   negative size), in place of the type's own;
/// - `unset`: the default when the file does not set the key, computed from the other
///   settings (`client_tls` is `allow` once a certificate and key are given). The plain
///   default is still what `General::default()` holds;
/// - `check`: what the value must satisfy, run after command-line flags, with the other
///   settings at hand. The message is read after the key (`general.NAME: must be ...`).
///
/// The order of the entries is the order of SHOW CONFIG and of the checks.
macro_rules! settings {
    // An entry's `unset`, as an Option (internal).
    (@unset $ty:ty) => { None::<fn(&General) -> $ty> };
    (@unset $ty:ty, $unset:expr) => { Some::<fn(&General) -> $ty>($unset) };

    ($(
        $(#[doc = $doc:literal])*
        $name:ident: $ty:ty = $default:expr, $reload:ident
            $(, range = $range:expr)?
            $(, unset = $unset:expr)?
            $(, check = $check:expr)?
        ;
    )*) => {
        /// `[general]`: settings of the whole process, and the defaults of every pool.
        /// Generated from the table in `config/settings.rs`.
        #[derive(Debug, Clone, PartialEq)]
        pub struct General {
            $(
                $(#[doc = $doc])*
                pub $name: $ty,
            )*
        }

        impl Default for General {
            fn default() -> Self {
                General { $($name: $default,)* }
            }
        }

        /// `[general]` as written in the file: every key optional and wide, so that each
        /// value is judged with its key name in hand.
        #[derive(serde::Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        pub(super) struct RawGeneral {
            $($name: Option<<$ty as $crate::config::table::Value>::Raw>,)*
        }

        impl RawGeneral {
            /// The settings the file gives, each read and judged on its own; the rest at
            /// their defaults.
            pub(super) fn into_general(
                self,
                cx: &$crate::config::table::Context<'_>,
            ) -> Result<General, $crate::config::ConfigError> {
                use $crate::config::table::Value;
                let mut g = General::default();
                $(
                    let $name = match self.$name {
                        None => true,
                        Some(raw) => {
                            let value = <$ty as Value>::read(raw, cx);
                            $(let value = value.map_err(|_| format!("must be {}", $range));)?
                            g.$name = value.map_err(|m| {
                                $crate::config::ConfigError::invalid(
                                    concat!("general.", stringify!($name)),
                                    m,
                                )
                            })?;
                            false
                        }
                    };
                )*
                $(
                    if let (true, Some(unset)) = ($name, settings!(@unset $ty $(, $unset)?)) {
                        g.$name = unset(&g);
                    }
                )*
                Ok(g)
            }
        }

        impl General {
            /// Every setting's bounds, in table order: run on the final values, after the
            /// command-line flags.
            pub(super) fn check(&self) -> Result<(), $crate::config::ConfigError> {
                use $crate::config::table::Value;
                $(
                    let key = concat!("general.", stringify!($name));
                    let invalid = |m| $crate::config::ConfigError::invalid(key, m);
                    self.$name.check().map_err(invalid)?;
                    $(
                        let check: fn(&$ty, &General) -> Result<(), String> = $check;
                        check(&self.$name, self).map_err(invalid)?;
                    )?
                )*
                Ok(())
            }

            /// SHOW CONFIG's rows for `[general]`: (key, value, default, changeable by
            /// RELOAD).
            pub fn rows(&self) -> Vec<(&'static str, String, String, bool)> {
                use $crate::config::table::{Reload, Value};
                let d = General::default();
                vec![$({
                    let default = match settings!(@unset $ty $(, $unset)?) {
                        Some(unset) => unset(self).show(),
                        None => d.$name.show(),
                    };
                    (
                        stringify!($name),
                        self.$name.show(),
                        default,
                        Reload::$reload == Reload::Live,
                    )
                },)*]
            }

            /// The reference of every setting, in table order.
            pub fn reference() -> Vec<$crate::config::table::SettingDoc> {
                use $crate::config::table::{Reload, SettingDoc, Value};
                let d = General::default();
                vec![$(SettingDoc {
                    name: stringify!($name),
                    default: d.$name.show(),
                    reload: Reload::$reload,
                    doc: [$($doc),*].map(str::trim).join(" "),
                },)*]
            }
        }
    };
}
pub(super) use settings;
