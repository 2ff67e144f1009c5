// A Go database/sql app on pgx's stdlib driver (tests/framework_apps.rs): every request in
// db.BeginTx with the default options (READ COMMITTED), committed at its end, rolled back
// by tx.Rollback. pgx prepares each statement under a name on a connection's first use and
// runs it by name after (its default statement cache): extended protocol, values as
// parameters. The requests and the transcript are those of tests/apps/python/workload.py
// (with Go's own random numbers): each goroutine owns the users whose id % THREADS is its
// number.
//
// Usage: go run . URL SEED THREADS REQUESTS
package main

import (
	"context"
	"database/sql"
	"fmt"
	"math"
	"math/rand"
	"os"
	"strconv"
	"strings"
	"sync"

	_ "github.com/jackc/pgx/v5/stdlib"
)

const users = 40

type op struct {
	n    int
	kind string
	uid  int
	what string
}

func plan(seed int64, threads, requests, t int) []op {
	rng := rand.New(rand.NewSource(seed*1000 + int64(t)))
	var own []int
	for id := 1; id <= users; id++ {
		if id%threads == t {
			own = append(own, id)
		}
	}
	ops := make([]op, 0, requests)
	for n := 0; n < requests; n++ {
		uid := own[int(float64(len(own))*math.Pow(rng.Float64(), 3))]
		r := rng.Float64()
		switch {
		case r < 0.07:
			ops = append(ops, op{n, "write", uid, []string{"insert", "like", "karma"}[rng.Intn(3)]})
		case r < 0.10:
			ops = append(ops, op{n, "rollback", uid, ""})
		default:
			ops = append(ops, op{n, "read", uid, ""})
		}
	}
	return ops
}

type transcript struct {
	t     string
	lines []string
}

// query runs q in tx and logs its rows, each column as text.
func (tr *transcript) query(tx *sql.Tx, n int, what, q string, args ...any) {
	rows, err := tx.Query(q, args...)
	if err != nil {
		panic(fmt.Sprintf("%s: %v", what, err))
	}
	defer rows.Close()
	cols, _ := rows.Columns()
	var out []string
	for rows.Next() {
		vals := make([]sql.NullString, len(cols))
		ptrs := make([]any, len(cols))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			panic(err)
		}
		var fields []string
		for _, v := range vals {
			fields = append(fields, strconv.Quote(v.String))
		}
		out = append(out, "("+strings.Join(fields, ", ")+")")
	}
	if err := rows.Err(); err != nil {
		panic(fmt.Sprintf("%s: %v", what, err))
	}
	tr.lines = append(tr.lines, fmt.Sprintf("t%s n%d %s: [%s]", tr.t, n, what, strings.Join(out, ", ")))
}

func (tr *transcript) user(tx *sql.Tx, n, uid int) {
	tr.query(tx, n, "user", "SELECT name, karma FROM users WHERE id = $1", uid)
}

func (tr *transcript) posts(tx *sql.Tx, n, uid int) {
	tr.query(tx, n, "posts", "SELECT title, likes FROM posts WHERE user_id = $1 ORDER BY title", uid)
}

func (tr *transcript) page(tx *sql.Tx, n, uid int) {
	tr.query(tx, n, "categories", "SELECT id, name FROM categories ORDER BY id")
	tr.user(tx, n, uid)
	tr.posts(tx, n, uid)
	tr.query(tx, n, "posts with categories",
		"SELECT p.title, c.name FROM posts p JOIN categories c ON c.id = p.category_id WHERE p.user_id = $1 ORDER BY p.title", uid)
	tr.query(tx, n, "post count", "SELECT count(*) FROM posts WHERE user_id = $1", uid)
}

func must(err error) {
	if err != nil {
		panic(err)
	}
}

// request runs body in a transaction begun with BeginTx; commits unless rollback.
func request(db *sql.DB, rollback bool, body func(tx *sql.Tx)) {
	tx, err := db.BeginTx(context.Background(), nil)
	must(err)
	body(tx)
	if rollback {
		must(tx.Rollback())
	} else {
		must(tx.Commit())
	}
}

func run(db *sql.DB, t int, ops []op, tr *transcript) {
	for _, o := range ops {
		n, uid := o.n, o.uid
		switch o.kind {
		case "read":
			request(db, false, func(tx *sql.Tx) { tr.page(tx, n, uid) })
		case "write":
			request(db, false, func(tx *sql.Tx) {
				tr.user(tx, n, uid)
				var err error
				switch o.what {
				case "insert":
					_, err = tx.Exec("INSERT INTO posts (user_id, category_id, title, likes) VALUES ($1, $2, $3, 0)",
						uid, n%5+1, fmt.Sprintf("u%d-t%d-n%d", uid, t, n))
				case "like":
					_, err = tx.Exec("UPDATE posts SET likes = likes + 1 WHERE id = (SELECT id FROM posts WHERE user_id = $1 ORDER BY title LIMIT 1)", uid)
				default:
					_, err = tx.Exec("UPDATE users SET karma = karma + 1 WHERE id = $1", uid)
				}
				must(err)
				tr.user(tx, n, uid)
				tr.posts(tx, n, uid)
			})
		default:
			request(db, true, func(tx *sql.Tx) {
				_, err := tx.Exec("UPDATE users SET karma = karma + 1000 WHERE id = $1", uid)
				must(err)
				_, err = tx.Exec("INSERT INTO posts (user_id, category_id, title, likes) VALUES ($1, 1, $2, -1)",
					uid, fmt.Sprintf("u%d-rolled-back-n%d", uid, n))
				must(err)
				tr.user(tx, n, uid)
				tr.posts(tx, n, uid)
			})
			request(db, false, func(tx *sql.Tx) {
				tr.user(tx, n, uid)
				tr.posts(tx, n, uid)
			})
		}
	}
}

func main() {
	if len(os.Args) != 5 {
		fmt.Fprintln(os.Stderr, "usage: URL SEED THREADS REQUESTS")
		os.Exit(2)
	}
	seed, _ := strconv.ParseInt(os.Args[2], 10, 64)
	threads, _ := strconv.Atoi(os.Args[3])
	requests, _ := strconv.Atoi(os.Args[4])
	db, err := sql.Open("pgx", os.Args[1])
	must(err)
	db.SetMaxOpenConns(threads)
	db.SetMaxIdleConns(threads)
	transcripts := make([]*transcript, threads)
	failed := make([]any, threads)
	var wg sync.WaitGroup
	for t := 0; t < threads; t++ {
		transcripts[t] = &transcript{t: strconv.Itoa(t)}
		wg.Add(1)
		go func(t int) {
			defer wg.Done()
			defer func() { failed[t] = recover() }()
			run(db, t, plan(seed, threads, requests, t), transcripts[t])
		}(t)
	}
	wg.Wait()
	for t, f := range failed {
		if f != nil {
			fmt.Fprintf(os.Stderr, "goroutine %d: %v\n", t, f)
			os.Exit(1)
		}
	}
	last := &transcript{t: "final"}
	request(db, false, func(tx *sql.Tx) {
		last.query(tx, 0, "all users", "SELECT id, name, karma FROM users ORDER BY id")
		last.query(tx, 0, "all posts", "SELECT user_id, title, likes, category_id FROM posts ORDER BY title")
	})
	must(db.Close())
	reads := 0
	for _, tr := range append(transcripts, last) {
		for _, line := range tr.lines {
			fmt.Println(line)
			reads++
		}
	}
	fmt.Printf("OK %d reads\n", reads)
}
