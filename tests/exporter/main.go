// A stand-in for prometheus-community/pgbouncer_exporter, for tests/monitoring.rs when the
// real exporter cannot be built (the Go module proxy here refuses its module). Written for
// pgmemo, not copied: it asks pgmemo's console what the exporter asks, through the same
// driver (lib/pq, simple queries over database/sql), reads the same columns and converts
// them by the same rules, and names its metrics as the exporter does. Where the exporter
// only logs a column it cannot convert, this fails the scrape (pgbouncer_up 0): stricter,
// so that a test catches what an operator would only see in the exporter's log.
//
// Flags as the exporter's: --pgBouncer.connectionString=URL --web.listen-address=HOST:PORT.
package main

import (
	"database/sql"
	"flag"
	"fmt"
	"log"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"

	_ "github.com/lib/pq"
)

// What each console command's columns become: a label, or a metric (name, factor).
type column struct {
	label  bool
	metric string
	factor float64
}

var namespaces = map[string]map[string]column{
	"databases": {
		"name": {label: true}, "host": {label: true}, "port": {label: true},
		"database": {label: true}, "force_user": {label: true}, "pool_mode": {label: true},
		"pool_size":           {metric: "pool_size", factor: 1},
		"reserve_pool":        {metric: "reserve_pool", factor: 1},
		"max_connections":     {metric: "max_connections", factor: 1},
		"current_connections": {metric: "current_connections", factor: 1},
		"paused":              {metric: "paused", factor: 1},
		"disabled":            {metric: "disabled", factor: 1},
	},
	"stats_totals": {
		"database":           {label: true},
		"query_count":        {metric: "queries_pooled_total", factor: 1},
		"query_time":         {metric: "queries_duration_seconds_total", factor: 1e-6},
		"bytes_received":     {metric: "received_bytes_total", factor: 1},
		"requests":           {metric: "queries_total", factor: 1},
		"bytes_sent":         {metric: "sent_bytes_total", factor: 1},
		"wait_time":          {metric: "client_wait_seconds_total", factor: 1e-6},
		"xact_count":         {metric: "sql_transactions_pooled_total", factor: 1},
		"xact_time":          {metric: "server_in_transaction_seconds_total", factor: 1e-6},
		"client_parse_count": {metric: "client_parses_total", factor: 1},
		"server_parse_count": {metric: "server_parses_total", factor: 1},
		"bind_count":         {metric: "binds_total", factor: 1},
	},
	"pools": {
		"database": {label: true}, "user": {label: true},
		"cl_active":             {metric: "client_active_connections", factor: 1},
		"cl_active_cancel_req":  {metric: "client_active_cancel_connections", factor: 1},
		"cl_waiting":            {metric: "client_waiting_connections", factor: 1},
		"cl_waiting_cancel_req": {metric: "client_waiting_cancel_connections", factor: 1},
		"sv_active":             {metric: "server_active_connections", factor: 1},
		"sv_active_cancel":      {metric: "server_active_cancel_connections", factor: 1},
		"sv_being_canceled":     {metric: "server_being_canceled_connections", factor: 1},
		"sv_idle":               {metric: "server_idle_connections", factor: 1},
		"sv_used":               {metric: "server_used_connections", factor: 1},
		"sv_tested":             {metric: "server_testing_connections", factor: 1},
		"sv_login":              {metric: "server_login_connections", factor: 1},
		"maxwait":               {metric: "client_maxwait_seconds", factor: 1},
	},
}

var lists = map[string]string{
	"databases": "databases", "users": "users", "pools": "pools",
	"free_clients": "free_clients", "used_clients": "used_clients",
	"login_clients": "login_clients", "free_servers": "free_servers",
	"used_servers": "used_servers", "dns_names": "cached_dns_names",
	"dns_zones": "cached_dns_zones", "dns_queries": "in_flight_dns_queries",
}

var configs = map[string]string{
	"max_client_conn":      "config_max_client_connections",
	"max_user_connections": "config_max_user_connections",
}

// toFloat converts a scanned value as the exporter does: numbers, and text that parses.
func toFloat(v interface{}) (float64, error) {
	switch x := v.(type) {
	case int64:
		return float64(x), nil
	case float64:
		return x, nil
	case []byte:
		return strconv.ParseFloat(string(x), 64)
	case string:
		return strconv.ParseFloat(x, 64)
	case nil:
		return 0, fmt.Errorf("NULL")
	}
	return 0, fmt.Errorf("type %T", v)
}

func toLabel(v interface{}) string {
	switch x := v.(type) {
	case nil:
		return ""
	case []byte:
		return string(x)
	default:
		return fmt.Sprint(x)
	}
}

func rowsOf(db *sql.DB, query string) ([]string, [][]interface{}, error) {
	rows, err := db.Query(query)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", query, err)
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		return nil, nil, err
	}
	var out [][]interface{}
	for rows.Next() {
		vals := make([]interface{}, len(cols))
		ptrs := make([]interface{}, len(cols))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			return nil, nil, fmt.Errorf("%s: %w", query, err)
		}
		out = append(out, vals)
	}
	return cols, out, rows.Err()
}

func scrape(dsn string) ([]string, error) {
	db, err := sql.Open("postgres", dsn)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	var out []string
	if _, _, err := rowsOf(db, "SHOW STATS"); err != nil { // the exporter's ping
		return nil, err
	}
	cols, rows, err := rowsOf(db, "SHOW VERSION;")
	if err != nil {
		return nil, err
	}
	if len(cols) != 1 || cols[0] != "version" {
		return nil, fmt.Errorf("SHOW VERSION: columns %v", cols)
	}
	for _, r := range rows {
		out = append(out, fmt.Sprintf("pgbouncer_version_info{version=%q} 1", toLabel(r[0])))
	}
	cols, rows, err = rowsOf(db, "SHOW LISTS;")
	if err != nil {
		return nil, err
	}
	if len(cols) != 2 {
		return nil, fmt.Errorf("SHOW LISTS: columns %v", cols)
	}
	for _, r := range rows {
		v, err := toFloat(r[1])
		if err != nil {
			return nil, fmt.Errorf("SHOW LISTS %v: %w", r[0], err)
		}
		if name, ok := lists[toLabel(r[0])]; ok {
			out = append(out, fmt.Sprintf("pgbouncer_%s %v", name, v))
		}
	}
	cols, rows, err = rowsOf(db, "SHOW CONFIG;")
	if err != nil {
		return nil, err
	}
	if len(cols) != 3 && len(cols) != 4 {
		return nil, fmt.Errorf("SHOW CONFIG: columns %v", cols)
	}
	for _, r := range rows {
		if name, ok := configs[toLabel(r[0])]; ok {
			v, err := toFloat(r[1])
			if err != nil {
				return nil, fmt.Errorf("SHOW CONFIG %v: %w", r[0], err)
			}
			out = append(out, fmt.Sprintf("pgbouncer_%s %v", name, v))
		}
	}
	for ns, mapping := range namespaces {
		cols, rows, err := rowsOf(db, "SHOW "+ns+";")
		if err != nil {
			return nil, err
		}
		var labelNames []string
		for name, c := range mapping {
			if c.label {
				labelNames = append(labelNames, name)
			}
		}
		sort.Strings(labelNames)
		for _, r := range rows {
			labels := make([]string, 0, len(labelNames))
			for _, l := range labelNames {
				value := ""
				for i, c := range cols {
					if c == l {
						value = toLabel(r[i])
					}
				}
				labels = append(labels, fmt.Sprintf("%s=%q", l, value))
			}
			for i, c := range cols {
				m, ok := mapping[c]
				if !ok || m.label {
					continue
				}
				v, err := toFloat(r[i])
				if err != nil {
					return nil, fmt.Errorf("SHOW %s column %s: %w", ns, c, err)
				}
				out = append(out, fmt.Sprintf("pgbouncer_%s_%s{%s} %v", ns, m.metric,
					strings.Join(labels, ","), v*m.factor))
			}
		}
	}
	return out, nil
}

func main() {
	dsn := flag.String("pgBouncer.connectionString", "", "the console's URL")
	listen := flag.String("web.listen-address", ":9127", "where /metrics is served")
	flag.Parse()
	http.HandleFunc("/metrics", func(w http.ResponseWriter, _ *http.Request) {
		lines, err := scrape(*dsn)
		up := 1
		if err != nil {
			log.Printf("scrape failed: %v", err)
			up = 0
		}
		lines = append(lines, fmt.Sprintf("pgbouncer_up %d", up))
		fmt.Fprintln(w, strings.Join(lines, "\n"))
	})
	server := &http.Server{Addr: *listen, ReadHeaderTimeout: 5 * time.Second}
	log.Fatal(server.ListenAndServe())
}
