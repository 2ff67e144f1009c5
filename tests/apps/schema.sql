-- The schema and seed every framework app of tests/framework_apps.rs runs on: a reference
-- table read by every request and never written (categories), users (written now and then)
-- and posts (written by ~7% of requests). Deterministic: two databases seeded with this file
-- hold the same rows.
CREATE TABLE categories (id int PRIMARY KEY, name text NOT NULL);
INSERT INTO categories SELECT g, 'category ' || g FROM generate_series(1, 5) g;
CREATE TABLE users (id int PRIMARY KEY, name text NOT NULL, karma int NOT NULL);
INSERT INTO users SELECT g, 'user ' || g, g * 10 FROM generate_series(1, 40) g;
CREATE TABLE posts (
    id serial PRIMARY KEY,
    user_id int NOT NULL REFERENCES users,
    category_id int NOT NULL REFERENCES categories,
    title text NOT NULL UNIQUE,
    likes int NOT NULL
);
INSERT INTO posts (user_id, category_id, title, likes)
    SELECT u, (u + k) % 5 + 1, 'u' || u || '-p' || k, u * k
    FROM generate_series(1, 40) u, generate_series(1, 3) k ORDER BY u, k;
