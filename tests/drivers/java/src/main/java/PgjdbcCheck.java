// pgjdbc through pgmemo in transaction mode, with prepareThreshold=1: every PreparedStatement
// runs as a named server-side statement (S_1, S_2, ... per connection) from its first
// execution, and pgjdbc's statement cache keeps it for later PreparedStatements of the same
// SQL, across transactions and so across server connections.
//
// Usage: java -jar pgjdbc-check.jar JDBC_URL TABLE [CLIENTS] [ITERATIONS]
//
// JDBC_URL carries user, password and prepareThreshold. TABLE must exist as (id int primary
// key, label text, amount int8) with ids 1..100, label 'item-<id>' and amount id*id;
// TABLE_log as (worker int, i int, note text, primary key (worker, i)) and TABLE_batch as
// (worker int, i int, j int, primary key (worker, i, j)), both empty. Each round's transaction
// also runs an executeBatch (several Bind/Execute, one Sync). Prints
// "MISMATCH: ..." for every wrong value, "ERROR: ..." for every unexpected error, and "OK ..."
// with exit code 0 when every check passed; exits 1 otherwise.

import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Types;
import java.util.ArrayList;
import java.util.List;
import java.util.Objects;
import java.util.concurrent.atomic.AtomicLong;

public final class PgjdbcCheck {
    /** Errors one worker records before giving up, so that a run without support ends quickly. */
    private static final int MAX_ERRORS = 5;

    private static final List<String> PROBLEMS = new ArrayList<>();
    private static final AtomicLong CHECKED = new AtomicLong();

    private static void problem(String p) {
        synchronized (PROBLEMS) {
            PROBLEMS.add(p);
        }
    }

    private static void check(Object got, Object want, String what) {
        CHECKED.incrementAndGet();
        if (!Objects.equals(got, want)) {
            problem("MISMATCH: " + what + ": expected " + want + ", got " + got);
        }
    }

    private final Connection conn;
    private final String table;
    private final int w;

    private PgjdbcCheck(Connection conn, String table, int w) {
        this.conn = conn;
        this.table = table;
        this.w = w;
    }

    /** Runs `sql` with `params` and returns its rows, every column as an Object. */
    private List<List<Object>> query(String sql, Object... params) throws SQLException {
        try (PreparedStatement ps = conn.prepareStatement(sql)) {
            for (int p = 0; p < params.length; p++) {
                if (params[p] == null) {
                    ps.setNull(p + 1, Types.BIGINT);
                } else {
                    ps.setObject(p + 1, params[p]);
                }
            }
            List<List<Object>> rows = new ArrayList<>();
            try (ResultSet rs = ps.executeQuery()) {
                int n = rs.getMetaData().getColumnCount();
                while (rs.next()) {
                    List<Object> row = new ArrayList<>();
                    for (int c = 1; c <= n; c++) {
                        row.add(rs.getObject(c));
                    }
                    rows.add(row);
                }
            }
            return rows;
        }
    }

    private List<Object> one(String sql, Object... params) throws SQLException {
        List<List<Object>> rows = query(sql, params);
        if (rows.size() != 1) {
            throw new SQLException(sql + ": expected one row, got " + rows.size());
        }
        return rows.get(0);
    }

    private void iteration(int i) throws SQLException {
        // Several parameter types, a NULL among them.
        String label = "w" + w + "-i" + i + "-é";
        List<Object> r = one("SELECT ?::int4 * 2 + ?::int4, ?::text || '!', ?::int8, ?::float8 / 4",
                w, i, label, null, (double) i);
        check(r.subList(0, 2), List.of(w * 2 + i, label + "!"), "arithmetic, text");
        check(r.get(2), null, "null");
        check(r.get(3), i / 4.0, "float");

        // A row by key, and an aggregate.
        int id = (w * 7 + i) % 100 + 1;
        r = one("SELECT label, amount FROM " + table + " WHERE id = ?", id);
        check(r, List.of("item-" + id, (long) id * id), "row by id");
        long n = i % 100 + 1;
        r = one("SELECT count(*), sum(amount)::int8 FROM " + table + " WHERE id <= ?", (int) n);
        check(r, List.of(n, n * (n + 1) * (2 * n + 1) / 6), "count and sum of squares");

        // Eight distinct statements, one per k, used in turn.
        int k = i % 8;
        r = one("SELECT ?::int4 + " + k, i);
        check(r, List.of(i + k), "distinct statement");

        // Several rows.
        int len = i % 5 + 1;
        List<List<Object>> rows = query("SELECT g, ?::text || g FROM generate_series(1, ?::int4) g", "r", len);
        List<List<Object>> want = new ArrayList<>();
        for (int j = 1; j <= len; j++) {
            want.add(List.of(j, "r" + j));
        }
        check(rows, want, "series");

        // An expected error now and then; the connection goes on.
        if (i % 10 == 3) {
            String state = null;
            try {
                one("SELECT 1 / ?::int4", 0);
            } catch (SQLException e) {
                state = e.getSQLState();
            }
            check(state, "22012", "division by zero");
        }

        // A transaction: insert, read back, commit.
        conn.setAutoCommit(false);
        try {
            String note = "note " + w + "/" + i;
            try (PreparedStatement ps =
                    conn.prepareStatement("INSERT INTO " + table + "_log (worker, i, note) VALUES (?, ?, ?)")) {
                ps.setInt(1, w);
                ps.setInt(2, i);
                ps.setString(3, note);
                check(ps.executeUpdate(), 1, "rows inserted");
            }
            r = one("SELECT note FROM " + table + "_log WHERE worker = ? AND i = ?", w, i);
            check(r, List.of(note), "note read back in the transaction");
            r = one("SELECT label, amount FROM " + table + " WHERE id = ?", id);
            check(r, List.of("item-" + id, (long) id * id), "row by id in the transaction");
            try (PreparedStatement ps =
                    conn.prepareStatement("INSERT INTO " + table + "_batch (worker, i, j) VALUES (?, ?, ?)")) {
                for (int j = 0; j < 3; j++) {
                    ps.setInt(1, w);
                    ps.setInt(2, i);
                    ps.setInt(3, j);
                    ps.addBatch();
                }
                check(ps.executeBatch().length, 3, "batch results");
            }
            r = one("SELECT count(*) FROM " + table + "_batch WHERE worker = ? AND i = ?", w, i);
            check(r, List.of(3L), "rows from executeBatch in the transaction");
            conn.commit();
        } catch (SQLException e) {
            try {
                conn.rollback();
            } catch (SQLException ignored) {
                // reported through `e`
            }
            throw e;
        } finally {
            conn.setAutoCommit(true);
        }
    }

    private void run(int iterations) {
        int errors = 0;
        long committed = 0;
        for (int i = 0; i < iterations; i++) {
            try {
                iteration(i);
                committed++;
            } catch (SQLException e) {
                problem("ERROR: worker " + w + " iteration " + i + ": " + e.getSQLState() + " " + e.getMessage());
                if (++errors >= MAX_ERRORS) {
                    return;
                }
            }
        }
        try {
            List<Object> r = one("SELECT count(*) FROM " + table + "_log WHERE worker = ?", w);
            check(r, List.of(committed), "worker " + w + ": rows committed");
        } catch (SQLException e) {
            problem("ERROR: worker " + w + ": " + e.getSQLState() + " " + e.getMessage());
        }
    }

    public static void main(String[] args) throws Exception {
        if (args.length < 2) {
            System.err.println("usage: pgjdbc-check JDBC_URL TABLE [CLIENTS] [ITERATIONS]");
            System.exit(2);
        }
        String url = args[0];
        String table = args[1];
        int clients = args.length > 2 ? Integer.parseInt(args[2]) : 24;
        int iterations = args.length > 3 ? Integer.parseInt(args[3]) : 30;
        List<Thread> threads = new ArrayList<>();
        for (int w = 0; w < clients; w++) {
            final int worker = w;
            Thread t = new Thread(() -> {
                try (Connection conn = DriverManager.getConnection(url)) {
                    new PgjdbcCheck(conn, table, worker).run(iterations);
                } catch (SQLException e) {
                    problem("ERROR: worker " + worker + ": connect: " + e.getSQLState() + " " + e.getMessage());
                }
            });
            t.start();
            threads.add(t);
        }
        for (Thread t : threads) {
            t.join(60_000);
            if (t.isAlive()) {
                problem("ERROR: timed out after 60 s");
                break;
            }
        }
        synchronized (PROBLEMS) {
            if (!PROBLEMS.isEmpty()) {
                PROBLEMS.forEach(System.out::println);
                System.out.flush();
                Runtime.getRuntime().halt(1);
            }
        }
        String version = org.postgresql.util.DriverInfo.DRIVER_VERSION;
        System.out.println("OK pgjdbc " + version + " (prepareThreshold=1): " + clients + " clients x "
                + iterations + " iterations, " + CHECKED.get() + " values checked");
    }
}
