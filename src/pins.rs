//! Why a client keeps its server in transaction mode: the pins the session-state watch
//! (`session::state`) finds, as a set of bits that the session, the statistics, the admin
//! console and the metrics all read. A room of its own so that those need not reach into the
//! session for it.

/// Why a client keeps its server (a set of bits).
pub struct Pins;

impl Pins {
    pub const TEMP: u8 = 1;
    pub const LISTEN: u8 = 2;
    pub const ADVISORY_LOCK: u8 = 4;
    pub const CURSOR: u8 = 8;
    pub const LOAD: u8 = 16;
    /// Settings pgmemo cannot name may have been set (`session::state::Custom::unnamed`): they cannot be
    /// carried to another server, nor reset for the next client. Until `RESET ALL` or
    /// `DISCARD ALL`.
    pub const SETTINGS: u8 = 32;

    pub const ALL: [(u8, &'static str); 6] = [
        (Self::TEMP, "temp"),
        (Self::LISTEN, "listen"),
        (Self::ADVISORY_LOCK, "advisory_lock"),
        (Self::CURSOR, "cursor"),
        (Self::LOAD, "load"),
        (Self::SETTINGS, "settings"),
    ];

    /// The reasons in `pins`, comma-separated (`""` for none), as SHOW CLIENTS prints them.
    pub fn describe(pins: u8) -> String {
        Self::ALL
            .iter()
            .filter(|(bit, _)| pins & bit != 0)
            .map(|(_, name)| *name)
            .collect::<Vec<_>>()
            .join(",")
    }
}
