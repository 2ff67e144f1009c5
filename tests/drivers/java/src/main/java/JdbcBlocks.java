// Blocks of reads through pgjdbc with autocommit off (run by tests/result_cache.rs): pgjdbc
// sends each block's BEGIN in the extended protocol in the same Sync as the block's first
// query (the unnamed statement at first, the named S_1 once prepareThreshold is reached), and
// COMMIT and ROLLBACK in the extended protocol too.
//
// Usage: java -cp pgjdbc-check.jar JdbcBlocks JDBC_URL WARM_ROUNDS ROUNDS
//
// The table kv must exist as (id int primary key, v int) with v = id for ids 1 and 2. Each
// round is a block that reads ids 1 and 2 and commits (every third rolls back). After
// WARM_ROUNDS rounds it prints "WARM" and waits for a line on stdin, then runs ROUNDS more on
// the same connection. Prints "MISMATCH: ..." or "ERROR: ..." and exits 1 on a problem, else
// "OK ...".

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;

public final class JdbcBlocks {
    private JdbcBlocks() {}

    private static int rounds(Connection c, PreparedStatement ps, int from, int to)
            throws SQLException {
        int problems = 0;
        for (int r = from; r < to; r++) {
            for (int id = 1; id <= 2; id++) {
                ps.setInt(1, id);
                try (ResultSet rs = ps.executeQuery()) {
                    if (!rs.next() || rs.getInt(1) != id || rs.next()) {
                        System.out.println("MISMATCH: round " + r + ", id " + id);
                        problems++;
                    }
                }
            }
            if (r % 3 == 2) {
                c.rollback();
            } else {
                c.commit();
            }
        }
        return problems;
    }

    public static void main(String[] args) throws Exception {
        String url = args[0];
        int warm = Integer.parseInt(args[1]);
        int measured = Integer.parseInt(args[2]);
        int problems = 0;
        try (Connection c = DriverManager.getConnection(url)) {
            c.setAutoCommit(false);
            try (PreparedStatement ps = c.prepareStatement("SELECT v FROM kv WHERE id = ?")) {
                problems += rounds(c, ps, 0, warm);
                System.out.println("WARM");
                System.out.flush();
                new BufferedReader(new InputStreamReader(System.in)).readLine();
                problems += rounds(c, ps, warm, warm + measured);
            }
        } catch (SQLException e) {
            System.out.println("ERROR: " + e.getSQLState() + " " + e.getMessage());
            System.exit(1);
        }
        if (problems > 0) {
            System.exit(1);
        }
        System.out.println("OK " + (warm + measured) + " rounds");
    }
}
