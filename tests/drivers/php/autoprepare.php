<?php
// PHP PDO through pgmemo with emulated prepares (PDO::ATTR_EMULATE_PREPARES): PDO splices the
// bound values into the text and sends simple-protocol queries, which pgmemo autoprepares.
//
// Usage: php autoprepare.php HOST PORT USER PASSWORD DB TABLE [ITERATIONS]
// TABLE as for autoprepare_psycopg2.py. Prints MISMATCH/ERROR lines, or "OK ..." and exits 0.

[$_, $host, $port, $user, $password, $db, $table] = $argv;
$iterations = (int)($argv[7] ?? 40);
$problems = [];
$checked = 0;

function check($got, $want, $what) {
    global $problems, $checked;
    $checked++;
    if ($got !== $want) {
        $problems[] = "MISMATCH: $what: expected " . var_export($want, true) . ", got " . var_export($got, true);
    }
}

try {
    $pdo = new PDO("pgsql:host=$host;port=$port;dbname=$db", $user, $password, [
        PDO::ATTR_ERRMODE => PDO::ERRMODE_EXCEPTION,
        PDO::ATTR_EMULATE_PREPARES => true,
        PDO::ATTR_STRINGIFY_FETCHES => true,
    ]);
    // pdo_pgsql reads the option from the handle and from each prepare(), not from the
    // constructor's options.
    $pdo->setAttribute(PDO::ATTR_EMULATE_PREPARES, true);
    $emulate = [PDO::ATTR_EMULATE_PREPARES => true];
    $byId = $pdo->prepare("SELECT label, amount FROM $table WHERE id = ?", $emulate);
    $text = $pdo->prepare("SELECT ?::text || '!', length(?)", $emulate);
    $insert = $pdo->prepare("INSERT INTO {$table}_log VALUES (?, ?, ?)", $emulate);
    for ($i = 0; $i < $iterations; $i++) {
        $id = ($i * 13) % 100 + 1;
        $byId->execute([$id]);
        check($byId->fetch(PDO::FETCH_NUM), ["item-$id", (string)($id * $id)], "row by id");
        $s = "it's $i \\ é";
        $text->execute([$s, $s]);
        check($text->fetch(PDO::FETCH_NUM), ["$s!", (string)preg_match_all('/./u', $s)], "quoted string");
        $pdo->beginTransaction();
        $insert->execute([99, $i, "php $i"]);
        $pdo->commit();
    }
    $n = $pdo->query("SELECT count(*) FROM {$table}_log WHERE worker = 99")->fetchColumn();
    check($n, (string)$iterations, "committed inserts");
    try {
        $byId->execute(["x"]);
        check("no error", "22P02", "invalid input");
    } catch (PDOException $e) {
        check($e->errorInfo[0], "22P02", "invalid input error");
    }
} catch (Throwable $e) {
    $problems[] = "ERROR: " . get_class($e) . ": " . $e->getMessage();
}
foreach (array_slice($problems, 0, 50) as $p) {
    echo "$p\n";
}
if ($problems) {
    exit(1);
}
echo "OK $checked values checked\n";
