# An ActiveRecord app (tests/framework_apps.rs), Debian's ruby-activerecord and ruby-pg, in
# Rails' usual transaction handling: every request in `ActiveRecord::Base.transaction do`,
# committed at its end, rolled back by `raise ActiveRecord::Rollback`. The connection is
# ActiveRecord's default one (it sets client_min_messages, standard_conforming_strings,
# intervalstyle = iso_8601 and the time zone at connect, reads the type map). The requests
# and the transcript are those of tests/apps/python/workload.py (with Ruby's own random
# numbers): each thread owns the users whose id % THREADS is its number.
#
# Usage: ruby activerecord_app.rb URL SEED THREADS REQUESTS [prepared_statements=true|false]
# URL: postgresql://user:password@host:port/db

require "active_record"
require "uri"

url, seed, threads, requests, prepared = ARGV
seed = Integer(seed)
threads = Integer(threads)
requests = Integer(requests)
u = URI.parse(url)

ActiveRecord::Base.establish_connection(
  adapter: "postgresql",
  host: u.host,
  port: u.port,
  username: u.user,
  password: u.password && URI.decode_www_form_component(u.password),
  database: u.path.delete_prefix("/"),
  pool: threads + 1,
  prepared_statements: prepared != "false",
)

class Category < ActiveRecord::Base; end
class User < ActiveRecord::Base; end
class Post < ActiveRecord::Base
  belongs_to :user
  belongs_to :category
end

USERS = 40

class Transcript
  attr_reader :lines

  def initialize(t)
    @t = t
    @lines = []
  end

  def log(n, what, rows)
    @lines << "t#{@t} n#{n} #{what}: #{rows.inspect}"
  end
end

# Records loaded as Rails apps load them (SELECT "users".* ... LIMIT $2, SELECT "posts".*
# ... ORDER BY "posts"."title"), besides pluck's named columns below.
def read_user(tr, n, uid)
  u = User.find(uid)
  tr.log(n, "user", [u.name, u.karma])
end

def read_posts(tr, n, uid)
  tr.log(n, "posts", Post.where(user_id: uid).order(:title).map { |p| [p.title, p.likes] })
end

def read_page(tr, n, uid)
  tr.log(n, "categories", Category.order(:id).pluck(:id, :name))
  read_user(tr, n, uid)
  read_posts(tr, n, uid)
  tr.log(n, "posts with categories",
         Post.where(user_id: uid).joins(:category).order(:title).pluck(:title, "categories.name"))
  tr.log(n, "post count", Post.where(user_id: uid).count)
end

def plan(seed, threads, requests, t)
  rng = Random.new(seed * 1000 + t)
  own = (1..USERS).select { |id| id % threads == t }
  (0...requests).map do |n|
    uid = own[(own.size * rng.rand**3).floor]
    r = rng.rand
    if r < 0.07
      [n, :write, uid, %i[insert like karma][rng.rand(3)]]
    elsif r < 0.10
      [n, :rollback, uid, nil]
    else
      [n, :read, uid, nil]
    end
  end
end

def run_thread(t, ops, tr)
  ActiveRecord::Base.connection_pool.with_connection do
    ops.each do |n, kind, uid, what|
      case kind
      when :read
        ActiveRecord::Base.transaction { read_page(tr, n, uid) }
      when :write
        ActiveRecord::Base.transaction do
          read_user(tr, n, uid)
          case what
          when :insert
            Post.create!(user_id: uid, category_id: n % 5 + 1, title: "u#{uid}-t#{t}-n#{n}", likes: 0)
          when :like
            Post.where(user_id: uid).order(:title).first.increment!(:likes)
          else
            User.where(id: uid).update_all("karma = karma + 1")
          end
          read_user(tr, n, uid)
          read_posts(tr, n, uid)
        end
      else
        ActiveRecord::Base.transaction do
          User.where(id: uid).update_all("karma = karma + 1000")
          Post.create!(user_id: uid, category_id: 1, title: "u#{uid}-rolled-back-n#{n}", likes: -1)
          read_user(tr, n, uid)
          read_posts(tr, n, uid)
          raise ActiveRecord::Rollback
        end
        ActiveRecord::Base.transaction do
          read_user(tr, n, uid)
          read_posts(tr, n, uid)
        end
      end
    end
  end
end

transcripts = (0...threads).map { |t| Transcript.new(t) }
errors = []
workers = (0...threads).map do |t|
  Thread.new do
    run_thread(t, plan(seed, threads, requests, t), transcripts[t])
  rescue StandardError => e
    errors << "thread #{t}: #{e.class}: #{e.message}\n#{e.backtrace.first(8).join("\n")}"
  end
end
workers.each(&:join)
unless errors.empty?
  warn errors.join("\n")
  exit 1
end
last = Transcript.new("final")
ActiveRecord::Base.transaction do
  last.log(0, "all users", User.order(:id).pluck(:id, :name, :karma))
  last.log(0, "all posts", Post.order(:title).pluck(:user_id, :title, :likes, :category_id))
end
reads = 0
(transcripts + [last]).each do |tr|
  tr.lines.each do |line|
    puts line
    reads += 1
  end
end
puts "OK #{reads} reads"
